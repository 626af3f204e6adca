"""The README and docs/ link every figure to a committed report: each report they name exists here
and git does not ignore it (a report written but ignored never reaches a clone)."""
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"\(((?:\.\./)?reports/[^)#\s]+)")


def _linked_reports() -> dict[str, set[str]]:
    pages = ["README.md"] + [os.path.join("docs", f) for f in sorted(os.listdir(os.path.join(ROOT, "docs")))
                             if f.endswith(".md")]
    out: dict[str, set[str]] = {}
    for page in pages:
        for link in LINK.findall(open(os.path.join(ROOT, page)).read()):
            path = os.path.normpath(os.path.join(os.path.dirname(page), link))
            out.setdefault(path, set()).add(page)
    return out


def test_every_linked_report_exists_and_is_not_ignored():
    linked = _linked_reports()
    assert len(linked) > 20, sorted(linked)          # the reader finds the links
    missing = {p: sorted(pages) for p, pages in linked.items() if not os.path.exists(os.path.join(ROOT, p))}
    assert not missing, f"reports linked but not here: {missing}"
    ignored = subprocess.run(["git", "check-ignore", *sorted(linked)], cwd=ROOT, capture_output=True, text=True)
    if ignored.returncode == 128:                     # not a git checkout (an unpacked copy): nothing to check
        return
    assert not ignored.stdout.strip(), f"reports linked but ignored by git: {ignored.stdout.split()}"
