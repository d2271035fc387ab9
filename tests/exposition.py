"""The admin port's ``/metrics`` as a test reads it: the exposition text, and one sample of it."""

from __future__ import annotations

import aiohttp


async def scrape(admin: str) -> str:
    """The exposition text of the admin listener at ``admin``."""
    async with aiohttp.ClientSession() as session, session.get(admin + "/metrics") as resp:
        return await resp.text()


def metric(text: str, name: str, **labels: str) -> float:
    """One sample of the exposition text (0 when absent)."""
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    return 0.0
