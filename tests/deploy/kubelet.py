"""What the kubelet would run for a shipped overlay, on this machine.

:func:`render` renders an overlay of ``deploy/k8s`` (``kubectl kustomize`` when it is on PATH,
else a small renderer for our own kustomizations: their ``resources``, recursively). :func:`pod`
turns the rendered Deployment into the plan of one replica: the upshift container's command
(the image's ``ENTRYPOINT`` plus the container's ``args``), its environment resolved as the
kubelet resolves it (``$(VAR)`` from earlier entries, field references), every mounted volume
written as the kubelet writes it (file modes from ``defaultMode``, group ownership from
``fsGroup``, emptyDirs 0777) and the container's uid, gid and groups. :func:`script` is the
shell script that starts it in a mount namespace of its own (:mod:`tests.deploy.world`).

Every Pod's network is one loopback address (127.0.0.2, 127.0.0.3, ...) of one private network
namespace. The configuration differs from a cluster's in the upstream URL alone (the manifests
name ``api.openai.com``; here it is the emulator on loopback), and, for a Deployment of several
replicas, in one more place: replicas share that namespace, so a listener on the wildcard address
binds the Pod's IP instead (in a Pod the wildcard means the Pod's own addresses: the same set of
connections reaches it). A single replica keeps the wildcard.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.tools import kustomize, which

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
NAMESPACE = "default"
UPSTREAM = "http://127.0.0.1:9100/v1"
"""Where the emulator listens in the private network namespace (instead of api.openai.com)."""

_LISTENERS = {"listen": "UPSHIFT_LISTEN", "admin_listen": "UPSHIFT_ADMIN_LISTEN"}
_PEER_LISTEN = "UPSHIFT_CLUSTER_PEER_LISTEN"


def render(overlay: str) -> list[dict[str, Any]]:
    """The objects of ``deploy/k8s/<overlay>`` as ``kubectl apply -k`` would create them."""
    kubectl = which("kubectl")
    if kubectl is not None:
        return kustomize(kubectl, K8S / overlay)
    return render_files(K8S / overlay)


def render_files(directory: Path) -> list[dict[str, Any]]:
    """Our kustomizations without kubectl: ``resources`` (files or directories), recursively."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text(encoding="utf-8"))
    docs: list[dict[str, Any]] = []
    for entry in spec.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            docs.extend(render_files(path))
        else:
            docs.extend(d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d)
    return docs


def templates(overlay: str) -> dict[str, dict[str, str]]:
    """The Secret templates shipped beside an overlay (not part of it): name -> keys."""
    out: dict[str, dict[str, str]] = {}
    for path in sorted((K8S / overlay).glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if doc and doc.get("kind") == "Secret":
                out[doc["metadata"]["name"]] = dict(doc.get("stringData") or {})
    return out


def entrypoint() -> list[str]:
    """The image's exec-form ``ENTRYPOINT``."""
    for line in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        if line.startswith("ENTRYPOINT "):
            value = json.loads(line.removeprefix("ENTRYPOINT "))
            assert isinstance(value, list)
            return [str(v) for v in value]
    raise AssertionError("deploy/Dockerfile has no ENTRYPOINT")


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def container(pod_spec: dict[str, Any], name: str) -> dict[str, Any]:
    for c in [*pod_spec.get("initContainers", []), *pod_spec.get("containers", [])]:
        if c["name"] == name:
            return dict(c)
    raise AssertionError(f"no container {name}")


_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(value: str, env: dict[str, str]) -> str:
    """``$(VAR)`` as the kubelet expands it: earlier variables only, ``$$`` escapes, unknown kept."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _REF.sub(sub, value)


def _field(path: str, meta: dict[str, Any], ip: str, pod_name: str) -> str:
    if path == "status.podIP":
        return ip
    if path in ("status.hostIP", "status.hostIPs"):
        return "127.0.0.1"
    if path == "metadata.namespace":
        return NAMESPACE
    if path == "metadata.name":
        return pod_name
    if path == "spec.nodeName":
        return "node-1"
    if path == "spec.serviceAccountName":
        return "default"
    label = re.fullmatch(r"metadata\.labels\['(.+)'\]", path)
    if label:
        return str(meta.get("labels", {}).get(label.group(1), ""))
    raise AssertionError(f"field reference {path} is not modelled")


def environment(
    c: dict[str, Any], meta: dict[str, Any], ip: str, pod_name: str, secrets: dict[str, dict[str, str]]
) -> dict[str, str]:
    """The container's ``env`` resolved in order, as the kubelet does."""
    env: dict[str, str] = {}
    for entry in c.get("env", []):
        name = entry["name"]
        if "value" in entry:
            env[name] = expand(str(entry["value"]), env)
            continue
        source = entry["valueFrom"]
        if "fieldRef" in source:
            env[name] = _field(source["fieldRef"]["fieldPath"], meta, ip, pod_name)
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[name] = secrets[ref["name"]][ref["key"]]
        else:
            raise AssertionError(f"env source {source} is not modelled")
    return env


@dataclass
class Pod:
    """One replica of the upshift container, ready to be started by :mod:`tests.deploy.world`."""

    name: str
    ip: str
    argv: list[str]
    env: dict[str, str]
    uid: int
    gid: int
    groups: list[int]
    read_only_root: bool
    mounts: list[tuple[str, str, bool]] = field(default_factory=list)
    """(source on this machine, mount path in the container, read-only)."""
    admin: str = ""
    """``host:port`` of the admin listener (the probes' target)."""
    probe: str = "/readyz"
    log: str = ""


def _write_volume(
    directory: Path, files: dict[str, str], mode: int, fs_group: int | None, *, read_only: bool = True
) -> None:
    """A Secret or ConfigMap volume as the kubelet writes it: ``mode`` per file, root-owned; with
    ``fsGroup`` group-owned by it and group-readable (the kubelet adds ``0440`` on read-only
    volumes, ``0660`` on others)."""
    directory.mkdir(parents=True)
    for key, text in files.items():
        path = directory / key
        path.write_text(text, encoding="utf-8")
        file_mode = mode
        if fs_group is not None:
            file_mode |= 0o440 if read_only else 0o660
        os.chown(path, 0, fs_group if fs_group is not None else 0)
        os.chmod(path, file_mode)
    os.chown(directory, 0, fs_group if fs_group is not None else 0)
    os.chmod(directory, 0o2755 if fs_group is not None else 0o755)


def _listen_host(value: str) -> str:
    return value.rsplit(":", 1)[0].strip("[]")


def pod(
    docs: list[dict[str, Any]],
    deployment: str,
    index: int,
    work: Path,
    secrets: dict[str, dict[str, str]],
) -> Pod:
    """The plan for replica ``index`` (pod IP ``127.0.0.<index + 2>``) of ``deployment``'s upshift
    container, its volumes written under ``work``."""
    dep = one(docs, "Deployment", deployment)
    template = dep["spec"]["template"]
    spec = template["spec"]
    meta = template["metadata"]
    c = container(spec, "upshift")
    ip = f"127.0.0.{index + 2}"
    name = f"{deployment}-{index}"
    pod_sc = spec.get("securityContext", {})
    c_sc = c.get("securityContext", {})
    uid = int(c_sc.get("runAsUser", pod_sc.get("runAsUser", 0)))
    gid = int(c_sc.get("runAsGroup", pod_sc.get("runAsGroup", 0)))
    fs_group = pod_sc.get("fsGroup")
    groups = [*([int(fs_group)] if fs_group is not None else []), *map(int, pod_sc.get("supplementalGroups", []))]
    configmaps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}

    work.mkdir(parents=True)
    volumes: dict[str, Path] = {}
    for vol in spec.get("volumes", []):
        target = work / "volumes" / vol["name"]
        if "configMap" in vol:
            src = vol["configMap"]
            _write_volume(target, configmaps[src["name"]], int(src.get("defaultMode", 0o644)), fs_group)
        elif "secret" in vol:
            src = vol["secret"]
            _write_volume(target, secrets[src["secretName"]], int(src.get("defaultMode", 0o644)), fs_group)
        elif "emptyDir" in vol:
            target.mkdir(parents=True)
            os.chown(target, 0, fs_group if fs_group is not None else 0)
            os.chmod(target, 0o2777 if fs_group is not None else 0o777)
        else:
            raise AssertionError(f"volume {vol} is not modelled")
        volumes[vol["name"]] = target
    mounts = [
        (str(volumes[m["name"]]), m["mountPath"], bool(m.get("readOnly", False))) for m in c.get("volumeMounts", [])
    ]
    # A mount inside another volume's mount path: the runtime makes its mount point in that volume.
    for _, dst, _ in mounts:
        for outer_src, outer_dst, _ in mounts:
            if dst.startswith(outer_dst.rstrip("/") + "/"):
                (Path(outer_src) / dst[len(outer_dst) :].strip("/")).mkdir(parents=True, exist_ok=True)

    env = environment(c, meta, ip, name, secrets)
    config = yaml.safe_load(configmaps["upshift-config"]["config.yaml"])
    if int(dep["spec"].get("replicas", 1)) > 1:
        # Replicas share one network namespace here: a wildcard host is the Pod's own address.
        for key, var in _LISTENERS.items():
            value = env.get(var, str(config.get(key, "")))
            if value and _listen_host(value) in ("0.0.0.0", "::"):
                env[var] = f"{ip}:{value.rsplit(':', 1)[1]}"
        if _PEER_LISTEN in env and _listen_host(env[_PEER_LISTEN]) in ("0.0.0.0", "::"):
            env[_PEER_LISTEN] = f"{ip}:{env[_PEER_LISTEN].rsplit(':', 1)[1]}"
    env["UPSHIFT_UPSTREAM"] = UPSTREAM
    admin = env.get("UPSHIFT_ADMIN_LISTEN", str(config.get("admin_listen", "")))
    if _listen_host(admin) in ("0.0.0.0", "::"):
        admin = f"{ip}:{admin.rsplit(':', 1)[1]}"  # the kubelet probes the Pod's IP

    # The image: its ENV and the product; the kubelet adds HOSTNAME.
    python_bin = str(Path(sys.executable).parent)
    image_env = {
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PATH": f"{python_bin}:/usr/local/bin:/usr/bin:/bin",
        "PYTHONPATH": str(ROOT),
        "HOSTNAME": name,
    }
    argv = [*(c.get("command") or entrypoint()), *c.get("args", [])]
    probe = c.get("startupProbe", {}).get("httpGet", {}).get("path", "/readyz")
    return Pod(
        name=name,
        ip=ip,
        argv=argv,
        env={**image_env, **env},
        uid=uid,
        gid=gid,
        groups=groups,
        read_only_root=bool(c_sc.get("readOnlyRootFilesystem", False)),
        mounts=mounts,
        admin=admin,
        probe=probe,
        log=str(work / "upshift.log"),
    )


def script(p: Pod, hosts: Path, work: Path) -> str:
    """A shell script that starts ``p`` (run it in a mount namespace of its own, as root).

    The container's root is an overlay of this machine's root (so the mount points can be made
    without touching the machine), the volumes bind-mounted at their mount paths (read-only where
    the manifest says so), ``/etc/hosts`` the cluster's names, the root remounted read-only when
    ``readOnlyRootFilesystem`` is set; then ``chroot`` and ``setpriv`` drop to the container's
    uid, gid and groups (no capabilities, no new privileges) and exec the command.
    """
    q = shlex.quote
    scratch = q(str(work / "root"))
    root = f"{work / 'root'}/merged"
    python_home = Path(sys.executable).resolve().parents[1]
    lines = [
        "set -eu",
        f"mkdir -p {scratch}",
        f"mount -t tmpfs tmpfs {scratch}",
        f"mkdir {scratch}/upper {scratch}/work {q(root)}",
        f"mount -t overlay overlay -o lowerdir=/,upperdir={scratch}/upper,workdir={scratch}/work {q(root)}",
    ]
    # This machine's interpreter and checkout stand in for the image's /opt/venv: every directory
    # above them traversable by the container's uid (in the overlay: this machine is unchanged).
    above: set[Path] = set()
    for place in (python_home, Path(sys.prefix), Path(sys.base_prefix), ROOT):
        above.update(place.parents)
    for parent in sorted(above, key=lambda p: len(p.parts)):
        lines.append(f"chmod o+x {q(root + str(parent))}")
    # Mount paths resolved inside the container's root (/var/run is a symlink to /run): the
    # overlay's lower layer is this machine's root, so resolving here resolves there.
    mounts = [(src, os.path.realpath(dst), ro) for src, dst, ro in p.mounts]
    for dst in ["/proc", "/dev", "/sys", *(dst for _, dst, _ in mounts)]:
        lines.append(f"mkdir -p {q(root + dst)}")
    if p.read_only_root:
        lines.append(f"mount --bind {q(root)} {q(root)}")
        lines.append(f"mount -o remount,bind,ro {q(root)}")
    for dst in ["/proc", "/dev", "/sys"]:
        lines.append(f"mount --rbind {dst} {q(root + dst)}")
    lines.append(f"mount --bind {q(str(hosts))} {q(root)}/etc/hosts")
    lines.append(f"mount -o remount,bind,ro {q(root)}/etc/hosts")
    for src, dst, ro in sorted(mounts, key=lambda m: m[1].count("/")):
        lines.append(f"mount --bind {q(src)} {q(root + dst)}")
        if ro:
            lines.append(f"mount -o remount,bind,ro {q(root + dst)}")
    # The stand-ins for the image's /opt/venv may lie under a volume's mount path (a venv or a
    # checkout under /tmp, where the gateway mounts an emptyDir): shown again on top, read-only.
    hidden = {
        str(place)
        for place in (python_home, Path(sys.prefix), Path(sys.base_prefix), ROOT)
        if any(str(place) == dst or str(place).startswith(dst.rstrip("/") + "/") for _, dst, _ in mounts)
    }
    for place in sorted(hidden):
        lines.append(f"mkdir -p {q(root + place)}")
        lines.append(f"mount --bind {q(place)} {q(root + place)}")
        lines.append(f"mount -o remount,bind,ro {q(root + place)}")
    setpriv = [
        shutil.which("setpriv") or "setpriv",
        f"--reuid={p.uid}",
        f"--regid={p.gid}",
        f"--groups={','.join(map(str, p.groups))}" if p.groups else "--clear-groups",
        "--no-new-privs",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--",
        "/usr/bin/env",
        "-i",
        *(f"{k}={v}" for k, v in p.env.items()),
        *p.argv,
    ]
    lines.append(f"cd {q(root)}")
    lines.append("exec chroot " + q(root) + " " + " ".join(q(a) for a in setpriv))
    return "\n".join(lines) + "\n"
