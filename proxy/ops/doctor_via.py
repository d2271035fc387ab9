"""``upshift doctor --via URL``: the doctor's conversation through a running sidecar, as an app.

Two turns, each with the whole history (as an app sends them); the sidecar should answer the
second as a continuation (``x-upshift-mode: continuation``). The response it made is then read
back from the upstream with the doctor's own credential: found, the sidecar talks to the same
upstream with the same credential. Last, the sidecar's admin port: ``/readyz`` and the version
in ``/metrics`` (``upshift_build_info``). Three requests, two of them through the sidecar.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp

from proxy.ops.doctor_report import Result, Status
from proxy.ops.doctor_wire import Upstream
from proxy.redact import redact_url

__all__ = ["via_check"]

_SPENT = "--max-requests reached"


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


async def via_check(
    up: Upstream,
    via: str,
    admin_url: str,
    make_body: Callable[..., dict[str, Any]],
    app_headers: Mapping[str, str],
) -> Result:
    """The ``via`` check.

    Args:
        up: The doctor's upstream (its budget counts the three requests).
        via: The sidecar's base URL (``/v1`` added when missing).
        admin_url: Its admin listener.
        make_body: Builds a ``POST /v1/responses`` body from input items.
        app_headers: The headers an app sends the sidecar (its credential in passthrough mode).
    """
    base = via.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    if up.budget.sent + 3 > up.budget.limit:
        return Result(Status.SKIP, f"not tried: {_SPENT} (it needs 3 requests)")
    fields: dict[str, Any] = {"first_turn": None, "second_turn": None, "same_upstream": None}
    headers = {**app_headers, "User-Agent": "upshift-doctor"}
    first_input = [_user("Through the sidecar: reply with one word: ok.")]
    one = await up.request("POST", "/v1/responses", make_body(first_input), headers=headers, base=base)
    fields["first_turn"] = one.headers.get("x-upshift-mode")
    if not one.answered:
        admin = fields["admin"] = await _probe_admin(admin_url.rstrip("/"))
        said = f"the sidecar at {redact_url(base)} answered the first turn with {one.describe()}"
        return Result(Status.FAIL, f"{said}; admin {admin['url']} {admin['readyz'] or 'unreachable'}", fields=fields)
    history = [*first_input, *((one.response or {}).get("output") or []), _user("Again: ok.")]
    two = await up.request("POST", "/v1/responses", make_body(history), headers=headers, base=base)
    fields["second_turn"] = two.headers.get("x-upshift-mode")
    problems: list[str] = []
    hint = ""
    if not two.answered:
        problems.append(f"the second turn got {two.describe()}")
    elif fields["second_turn"] != "continuation":
        problems.append(f"the second turn was sent as {fields['second_turn']!r}, not continued")
        hint = "see the sidecar's access log (reason, miss_item) or 'upshift explain'"
    seen = await up.request("GET", f"/v1/responses/{two.response_id}") if two.answered else None
    if seen is not None and seen.failure:
        problems.append(f"reading the response back from the upstream failed: {seen.describe()}")
    elif seen is not None:
        fields["same_upstream"] = seen.status == 200
    if fields["same_upstream"] is False and seen is not None:
        problems.append(
            f"the response it made is not visible to the doctor's key at its upstream ({seen.describe()}): "
            "the sidecar uses another upstream or another credential"
        )
    admin = await _probe_admin(admin_url.rstrip("/"))
    fields["admin"] = admin
    detail = f"through {redact_url(base)}: turns {fields['first_turn']} then {fields['second_turn']}"
    if fields["same_upstream"]:
        detail += "; same upstream and credential as the doctor"
    detail += f"; admin {admin['url']} {admin['readyz'] or 'unreachable'}"
    if admin.get("version"):
        detail += f" (upshift {admin['version']})"
    if problems:
        return Result(Status.FAIL, f"{detail}: {'; '.join(problems)}", hint, fields)
    if admin["readyz"] != "ready":
        return Result(Status.WARN, detail, "--via-admin URL: the sidecar's admin_listen", fields)
    return Result(Status.PASS, detail, fields=fields)


async def _probe_admin(url: str) -> dict[str, Any]:
    """``/readyz`` and ``/metrics`` of the sidecar's admin port (not upstream requests)."""
    found: dict[str, Any] = {"url": url, "readyz": None, "version": None}
    timeout = aiohttp.ClientTimeout(total=5.0)
    try:
        async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as session:
            async with session.get(url + "/readyz") as resp:
                found["readyz"] = "ready" if resp.status == 200 else f"HTTP {resp.status}"
            async with session.get(url + "/metrics") as resp:
                text = await resp.text()
            match = re.search(r'upshift_build_info\{[^}]*version="([^"]+)"', text)
            found["version"] = match.group(1) if match else None
    except (aiohttp.ClientError, TimeoutError):
        pass
    return found
