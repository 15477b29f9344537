"""Every command in the documentation runs as written: README.md and docs/**/*.md, discovered.

The convention (docs/contributing.md, "Documentation"):

* a ```bash fence is run with ``bash -e`` from a clone-like copy of the repository root (a fresh
  temporary directory holding a copy of the files git tracks, so what a command writes -- ``data/``,
  ``runs/``, ``hf/`` -- never lands in the checkout), on CPU, in the normal tier. The blocks of one
  page run in order in one such directory, sharing its files (the tour: prepare, then train, then
  resume);
* ``<!-- docs: slow -->`` on the line before the fence puts the block in the slow tier (more than
  ~10 s, or several processes): the page's slow test runs all its blocks in order (or, after the
  page's normal-tier test passed in the same session, only its slow blocks, in that test's
  directory: the cheap ones before them have run there already);
* ``<!-- docs: skip: REASON -->`` skips it, and REASON must be one of :data:`SKIP_REASONS`;
* ``<!-- docs: setup -->`` marks the set-up commands (install, then the main job or the tests):
  they would re-install into the running environment and start this suite inside itself, so they
  are checked instead to be ``.ci/run``'s install command verbatim, followed by ``portatrain`` or
  by ``.ci/run``'s own test command;
* ``<!-- docs: output -->`` before a ```text fence checks that block against what the bash block
  before it printed (stdout and stderr): each line of the block must appear in the output, in
  order; text must match exactly and every number within the relative tolerance of
  ``<!-- docs: output rtol=R -->`` (default 0: exact), ``rtol=any`` for numbers whose value varies
  (times, throughput) but whose place and format do not; a line ``...`` stands for any lines.

``mkdocs build --strict`` checks the site: no broken link, no page missing from the nav.

How the commands start (each new interpreter would spend ~6 CPU-s importing torch, Hydra and
portatrain; the pages run about fifty of them). ``portatrain``, ``python`` and ``python3`` are shims,
first on ``PATH``, that hand the command to ``tests/fork_client.py``: the process is a fork of the test
process's fork server, which imported those libraries once (``tests/fork_server.py`` says what a fork
keeps of a new interpreter: argv, ``sys.path``, cwd, environment, streams, exit status, signals).
``portatrain`` runs the installed console script itself as the client's ``SCRIPT`` (the same file,
``sys.argv[0]`` and ``sys.path[0]`` as the real command); ``python`` passes its arguments on, and the
client starts a real interpreter for a form it does not serve. ``torchrun`` stays real (only slow
blocks use it). Two things make the forks the process a user's command would be:

* the code is the clone's own: the server imported the checkout's ``src/``, and the ``conf/`` and
  ``recipes/`` beside it that the CLI reads, so the copy's ``src/`` goes on ``PYTHONPATH`` only when
  those files differ from the copy's (:func:`same_code`); a server would refuse such a ``PYTHONPATH``
  (another portatrain), and every command would then start a real interpreter, as before;
* the blocks run with ``OMP_NUM_THREADS=1``, as every process this suite starts (the server imported
  torch so, and refuses an environment whose import-time variables differ): one compute thread per
  process on the suite's two workers over two cores. What the pages check -- messages, exit statuses,
  losses within their tolerance -- does not depend on the thread count.
"""

from __future__ import annotations

import filecmp
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP_REASONS = ("needs a CUDA GPU", "needs a TPU", "needs a Trainium host", "needs a hub download")
RUN_FENCES = ("bash", "sh", "shell")
DOCS_SLOW = os.environ.get("PORTATRAIN_DOCS_SLOW") == "1"
DOCS_SLOW_REASON = (
    "the docs' slow blocks (multi-process runs, long trainings: about 10 minutes on 2 cores) run with "
    "PORTATRAIN_DOCS_SLOW=1; the default suite leaves them out to stay within its 25-minute budget, and "
    "the features they show have multi-process tests of their own"
)
BLOCK_TIMEOUT_S = {"normal": 600, "slow": 1200}  # generous: a loaded 2-core machine
_MARKER = re.compile(r"<!--\s*docs:\s*(.*?)\s*-->")
_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][+-]?\d+)?")


@dataclass
class Block:
    page: str
    line: int
    code: str
    tier: str = "normal"  # normal | slow | skip
    reason: str = ""
    outputs: list[tuple[str, str]] = field(default_factory=list)
    """``(expected text, rtol)`` of the checked ```text blocks that follow this one."""


def setup_commands() -> tuple[str, str]:
    """The install + main job, and the install + tests: ``.ci/run``'s command and its install part."""
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("pip install")]
    install = ci[0].split(" && ")[0]
    return f"{install} && portatrain", ci[0]


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def parse(path: Path, root: Path = ROOT) -> tuple[list[Block], list[str]]:
    """The shell blocks of a Markdown page, and the convention's violations found on it."""
    name = str(path.relative_to(root))
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    problems: list[str] = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence, lang = match.groups()
        start = i
        i += 1
        body = []
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1
        marker = ""
        if start > 0:
            found = _MARKER.search(lines[start - 1])
            marker = found.group(1) if found else ""
        where = f"{name}:{start + 1}"
        if lang == "console":
            problems.append(
                f"{where}: a ```console block; write the command in ```bash, its output in ```text"
            )
        elif lang in RUN_FENCES:
            block = Block(name, start + 1, "\n".join(body))
            if marker == "slow":
                block.tier = "slow"
            elif marker == "setup":
                block.tier = "setup"
                if block.code.strip() not in setup_commands():
                    problems.append(
                        f"{where}: a setup block must be one of {setup_commands()} (.ci/run's install command)"
                    )
            elif marker.startswith("skip"):
                block.tier, block.reason = "skip", marker.partition(":")[2].strip()
                if block.reason not in SKIP_REASONS:
                    problems.append(
                        f"{where}: skip reason {block.reason!r} is not one of {', '.join(SKIP_REASONS)}; "
                        "a block that runs here but slowly is <!-- docs: slow -->"
                    )
            elif marker:
                problems.append(f"{where}: unknown marker <!-- docs: {marker} --> before a shell block")
            blocks.append(block)
        elif marker.startswith("output"):
            rtol = dict(re.findall(r"(\w+)=(\S+)", marker)).get("rtol", "0")
            if not blocks or lang != "text":
                problems.append(
                    f"{where}: <!-- docs: output --> must mark a ```text block after a ```bash block"
                )
            else:
                blocks[-1].outputs.append(("\n".join(body), rtol))
    return blocks, problems


def _numbers_match(expected: str, actual: str, rtol: str) -> bool:
    want, got = _NUMBER.findall(expected), _NUMBER.findall(actual)
    if _NUMBER.sub("#", expected) != _NUMBER.sub("#", actual) or len(want) != len(got):
        return False
    if rtol == "any":
        return True
    tolerance = float(rtol)
    for a, b in zip(want, got):
        x, y = float(a.replace(",", "")), float(b.replace(",", ""))
        if abs(x - y) > tolerance * max(abs(x), abs(y)):
            return False
    return True


def output_mismatch(expected: str, printed: str, rtol: str) -> str | None:
    """None when every expected line appears in ``printed`` in order (``...`` skips any lines)."""
    actual = [line.rstrip() for line in printed.splitlines()]
    position = 0
    for line in expected.splitlines():
        line = line.rstrip()
        if line in ("...", ""):
            continue
        for k in range(position, len(actual)):
            if _numbers_match(line, actual[k], rtol):
                position = k + 1
                break
        else:
            return f"expected line not printed (in order, rtol={rtol}): {line!r}"
    return None


def clone_like(workdir: Path) -> None:
    """``workdir`` as a fresh clone: a copy of the checkout's files that git tracks or would track
    (about 3 MB), none of what commands wrote into it (git-ignored) and no ``.git``. Copies, not
    links, so that paths printed by a command read as they would in a clone."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for name in filter(None, listed.split("\0")):
        source, target = ROOT / name, workdir / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():  # conf/recipe -> ../recipes, as git stores it
            target.symlink_to(os.readlink(source))
        elif source.is_file():
            shutil.copy2(source, target)


_NORMAL_TIER_DONE: dict[str, Path] = {}
"""Page -> the directory its normal-tier blocks ran in, in this session: the page's slow test goes on
there with its slow blocks only, instead of running every cheap block a second time."""


CODE_DIRS = ("src", "conf", "recipes")
"""What ``import portatrain`` runs and reads: the package, and the configs its CLI finds beside it."""


def same_code(workdir: Path) -> bool:
    """Whether the imported portatrain is the copy's: its checkout (``src/portatrain/../..``) holds
    the same files, byte for byte, under :data:`CODE_DIRS` (no more ``.py`` files, none differing)."""
    import portatrain

    imported = Path(portatrain.__file__).resolve().parents[2]
    for name in CODE_DIRS:
        copied = {p.relative_to(workdir) for p in (workdir / name).rglob("*") if p.is_file()}
        extra = {p.relative_to(imported) for p in (imported / name).rglob("*.py")}
        if {p for p in copied if p.suffix == ".py"} != extra:
            return False
        if not all(filecmp.cmp(workdir / p, imported / p, shallow=False) for p in copied):
            return False
    return True


def fork_shims(bin_dir: Path) -> Path:
    """``bin_dir`` holding the ``portatrain``, ``python`` and ``python3`` shims (module docstring)."""
    client = [sys.executable, "-S", str(ROOT / "tests" / "fork_client.py")]
    scripts = {"python": client, "python3": client}
    console = Path(sys.executable).parent / "portatrain"  # pip's script: `#!<python>`, then main()
    shebang = console.read_bytes().partition(b"\n")[0][2:].strip().decode() if console.is_file() else ""
    if shebang and os.path.realpath(shebang) == os.path.realpath(sys.executable):  # else: left real
        scripts["portatrain"] = [*client, str(console)]
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, command in scripts.items():
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\nexec {" ".join(map(shlex.quote, command))} "$@"\n')
        shim.chmod(0o755)
    return bin_dir


def run_page(page: str, tier: str, tmp_path: Path) -> None:
    blocks, problems = parse(ROOT / page)
    assert not problems, "\n".join(problems)
    resumed = tier == "slow" and page in _NORMAL_TIER_DONE
    if resumed:
        tmp_path = _NORMAL_TIER_DONE[page]
    else:
        clone_like(tmp_path)
    own_src = [] if same_code(tmp_path) else [str(tmp_path / "src")]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([*own_src, str(tmp_path), os.environ.get("PYTHONPATH", "")]),
    }
    shims = fork_shims(tmp_path.parent / f"{tmp_path.name}-bin")
    env["PATH"] = os.pathsep.join([str(shims), str(Path(sys.executable).parent), env.get("PATH", "")])
    for block in blocks:
        if block.tier in ("skip", "setup") or (tier == "normal" and block.tier == "slow"):
            continue
        if resumed and block.tier != "slow":  # ran in the normal tier, in this directory
            continue
        proc = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", block.code],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=BLOCK_TIMEOUT_S[block.tier],
        )
        printed = proc.stdout
        assert proc.returncode == 0, (
            f"{block.page}:{block.line} exited {proc.returncode}:\n{block.code}\n--- output (tail) ---\n{printed[-4000:]}"
        )
        for expected, rtol in block.outputs:
            problem = output_mismatch(expected, printed, rtol)
            assert problem is None, (
                f"{block.page}:{block.line}: {problem}\n--- printed ---\n{printed[-4000:]}"
            )
    if tier == "normal":
        _NORMAL_TIER_DONE[page] = tmp_path


def _cases() -> list:
    cases = []
    for path in pages():
        blocks, _ = parse(path)
        page = str(path.relative_to(ROOT))
        tiers = {b.tier for b in blocks}
        if tiers & {"normal"}:
            cases.append(pytest.param(page, "normal", id=f"{page}-normal"))
        if "slow" in tiers:
            marks = [pytest.mark.slow, pytest.mark.skipif(not DOCS_SLOW, reason=DOCS_SLOW_REASON)]
            cases.append(pytest.param(page, "slow", id=f"{page}-slow", marks=marks))
    return cases


@pytest.mark.parametrize(("page", "tier"), _cases())
def test_docs_commands_run_as_written(page: str, tier: str, tmp_path: Path) -> None:
    run_page(page, tier, tmp_path)


@pytest.mark.parametrize("path", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_follow_the_convention(path: Path) -> None:
    _, problems = parse(path)
    assert not problems, "\n".join(problems)


def test_convention_checker_catches_what_it_should(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- docs: skip: too slow -->\n```bash\ntrue\n```\n```console\n$ ls\n```\n"
        "<!-- docs: slow -->\n```bash\necho step 10 loss 4.159 tok_s 1,486\n```\n"
        "<!-- docs: output rtol=0.01 -->\n```text\nstep 10 loss 4.16 tok_s 1,486\n```\n"
    )
    blocks, problems = parse(page, root=tmp_path)
    assert [b.tier for b in blocks] == ["skip", "slow"]
    assert len(problems) == 2 and "too slow" in problems[0] and "console" in problems[1]
    (expected, rtol), printed = blocks[1].outputs[0], "step 10  loss 4.159 tok_s 1,486"
    assert output_mismatch(expected, "x\nstep 10 loss 4.159 tok_s 1,486\n", rtol) is None
    assert output_mismatch(expected, printed, rtol) is not None  # spacing is format
    assert output_mismatch(expected, "step 10 loss 4.5 tok_s 1,486", rtol) is not None
    assert output_mismatch("tok_s 9", "tok_s 1,486", "any") is None


def test_commands_fork_only_when_the_copy_runs_the_imported_code(tmp_path: Path) -> None:
    clone_like(tmp_path / "clone")
    assert same_code(tmp_path / "clone")
    recipe = next((tmp_path / "clone" / "recipes").glob("*.yaml"))
    recipe.write_text(recipe.read_text() + "# edited in the clone\n")
    assert not same_code(tmp_path / "clone")  # the copy's src/ then goes first on PYTHONPATH


def test_mkdocs_site_builds_strictly(tmp_path: Path) -> None:
    if shutil.which("mkdocs") is None:
        pytest.skip("mkdocs is not installed (pip install 'portatrain[docs]')")
    proc = subprocess.run(
        ["mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
