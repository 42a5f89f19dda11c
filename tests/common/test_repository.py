"""The repository itself: nothing tracked may depend on the machine that committed it.

Stdlib only, so `.ci/run` can run it (`python3 tests/common/test_repository.py`) before installing anything.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def escaping_links(repo: Path) -> list[str]:
    """Tracked symbolic links whose target is absolute or leaves the repository, one line each."""
    listing = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-s", "-z"], check=True, capture_output=True, text=True
    ).stdout
    problems = []
    for entry in filter(None, listing.split("\0")):
        meta, path = entry.split("\t", 1)
        mode, blob = meta.split()[:2]
        if mode != "120000":  # git's mode for a symbolic link
            continue
        target = subprocess.run(
            ["git", "-C", str(repo), "cat-file", "blob", blob], check=True, capture_output=True, text=True
        ).stdout
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), target))
        if os.path.isabs(target) or resolved == ".." or resolved.startswith("../"):
            problems.append(f"{path} is a tracked symbolic link to {target}, outside the repository: "
                            f"git rm --cached {path} (and list it in .gitignore if it is machine-local)")
    return problems


def test_no_tracked_link_points_outside_the_repository():
    assert escaping_links(REPO) == []


def test_the_check_catches_absolute_and_escaping_links(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "inside").write_text("x")
    os.symlink("/tmp/somewhere", tmp_path / ".mpich")
    os.symlink("../../elsewhere", tmp_path / "up")
    os.symlink("inside", tmp_path / "fine")
    subprocess.run(["git", "-C", str(tmp_path), "add", "-A"], check=True)
    problems = escaping_links(tmp_path)
    assert len(problems) == 2
    assert problems[0].startswith(".mpich is a tracked symbolic link to /tmp/somewhere")
    assert problems[1].startswith("up is a tracked symbolic link to ../../elsewhere")


if __name__ == "__main__":
    found = escaping_links(REPO)
    for line in found:
        print(f"error: {line}", file=sys.stderr)
    sys.exit(1 if found else 0)
