"""The project's images run as their pods run them, under podman on this machine (e2e/test_images.py,
benchmarks/image_start.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pagedserve.testing import pods

# crun, podman's default runtime, refuses the cgroup layout of the machines this runs on.
PODMAN = ["podman", "--runtime", "runc"]
NAME_PREFIX = "pagedserve-image-test"


def podman_run(pod: dict[str, Any], argv: list[str], workdir: Path) -> list[str]:
    """`podman run` of the rendered container's image as in its pod, running ``argv`` (its first word as
    the entry point)."""
    container, security = pod["container"], pod["securityContext"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    uid, gid, fs_group = security["runAsUser"], security["runAsGroup"], security["fsGroup"]
    name = f"{NAME_PREFIX}-{container['name']}-{os.getpid()}"
    run = [*PODMAN, "run", "--rm", "--name", name, "--network", "host", "--user", f"{uid}:{gid}"]
    # --read-only-tmpfs=false: podman would otherwise mount writable tmpfs on /tmp, /var/tmp and /run.
    run += ["--read-only", "--read-only-tmpfs=false", "--group-add", str(fs_group)]
    run += ["--cap-drop", "all", "--security-opt", "no-new-privileges"]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    for mount in container["volumeMounts"]:
        empty_dir = volumes[mount["name"]]["emptyDir"]  # the only kind the CPU pods mount
        if empty_dir.get("medium") == "Memory":
            from kubernetes.utils.quantity import parse_quantity

            size = int(parse_quantity(empty_dir["sizeLimit"]))
            run += ["--mount", f"type=tmpfs,destination={mount['mountPath']},tmpfs-size={size}"]
        else:
            folder = workdir / f"{container['name']}-{mount['name']}"
            folder.mkdir()
            os.chown(folder, uid, fs_group)  # fsGroup makes a pod's volumes its group's
            folder.chmod(0o2775)
            run += ["-v", f"{folder}:{mount['mountPath']}"]
    for item in container["env"]:
        run += ["-e", f"{item['name']}={pods.env_value(item)}"]
    return [*run, "--entrypoint", argv[0], container["image"], *argv[1:]]
