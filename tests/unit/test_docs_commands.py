"""Every command README.md and docs/*.md give is run by a test or by CI (``.ci/run``).

The commands are read from the pages themselves: each line of a ```bash block (``\\`` continuations joined,
comments dropped) and each inline `` `python ...` ``, `` `bash ...` ``, `` `torchrun ...` ``, `` `pip ...` ``.
Each must match one row of :data:`RUN_BY`, whose file must still hold the strings that run it; a command that
cannot run here (a CUDA-only extra) is listed in :data:`NOT_RUN` with the reason. A new command in the docs
without a row fails here; so does a row whose command left the docs or whose test stopped running it. The ```python
blocks (snippets around the reader's own model) must parse, import only names that exist and pass only real options.

Mutations seen failing: a new ```bash line (``python -m lightning_vitscale frobnicate``); the ``--weights ema``
test removed from test_ema.py (its needle); a row whose command no longer appears in any page;
``VitScaleStrategy(offloading=None)`` in docs/multinode.md; a link to ``moving-over.md#from-dp``.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# README's test command, which .ci/run runs as written: every test on two workers, a file at a time.
TEST_COMMAND = "python -m pytest -q -n 2 --dist loadfile"

# command pattern (re.match on the whitespace-normalised command) -> (file that runs it, strings that file holds)
RUN_BY: dict[str, tuple[str, tuple[str, ...]]] = {
    r"python -m venv \.venv && \. \.venv/bin/activate$": (".ci/run", ("python3 -m venv", '. "$venv/bin/activate"')),
    r"pip install torch==2\.14\.1 torchvision==0\.29\.1$": (
        ".ci/run", ("pip install --quiet torch==2.14.1 torchvision==0.29.1",),
    ),
    r'pip install -e "\.\[test,examples\]"$': (".ci/run", ('pip install --quiet -e ".[test,examples]"',)),
    r"python -m pytest -q$": (".ci/run", ("python -m pytest -q",)),
    r"python -m pytest -q -n 2 --dist loadfile$": (".ci/run", (TEST_COMMAND,)),
    r"bash \.ci/run$": (".ci/run", (TEST_COMMAND, "lint-imports")),
    r"python -m pytest -m gpu$": ("benchmarks/gpu_run.sh", ("-m pytest -m gpu tests/gpu",)),
    r"bash benchmarks/gpu_run\.sh( OUT_DIR)?$": (".ci/run", ("bash benchmarks/gpu_run.sh",)),
    r"bash benchmarks/gpu_run\.sh OUT_DIR --dry-run$": (
        ".ci/run", ('bash benchmarks/gpu_run.sh "$gpu_dry_run" --dry-run',),
    ),
    # The main job and the examples, launched as a user would (tests/examples/_run.py: CPU2 = the two flags).
    r"python examples/(classification|detection|video)\.py fit --trainer\.accelerator=cpu --trainer\.devices=2$": (
        "tests/examples/_run.py",
        ('f"examples/{task}.py", "fit", *CPU2', '"--trainer.accelerator=cpu", "--trainer.devices=2"'),
    ),
    r"python examples/pretraining\.py fit --trainer\.accelerator=cpu --trainer\.devices=2$": (
        "tests/examples/scripts/examples_matrix.py",
        ("pretraining.main(", '"--trainer.accelerator=cpu", "--trainer.devices=2"'),
    ),
    # The EMA switch through the example's own CLI (parsed into a Trainer with the callback, not fitted).
    r"python examples/classification\.py fit --config \S+ --trainer\.callbacks\+=lightning_vitscale\.ShardedEMA"
    r" --trainer\.callbacks\.decay=\S+$": (
        "tests/unit/averaging/test_ema.py",
        ('"--trainer.callbacks+=lightning_vitscale.ShardedEMA", "--trainer.callbacks.decay=0.99"', "run_cli("),
    ),
    r"python -m lightning_vitscale demo$": ("tests/distributed/test_cli.py", ('"-m", "lightning_vitscale", "demo"',)),
    r"python -m lightning_vitscale plan( --config examples/configs/classification_vit_h\.yaml"
    r" --model examples\.classification:ViTClassifier --init-args num_classes=1000 --devices 8 --nodes 1"
    r" --memory a100-40gb)?$": (
        "tests/unit/memory/test_memory_planner.py",
        ('main(["plan", "--config", "examples/configs/classification_vit_h.yaml"', '"--memory", "a100-40gb"'),
    ),
    r"python -m lightning_vitscale consolidate( checkpoints/last\.ckpt checkpoints/last\.consolidated\.ckpt"
    r"| <path> <stem>\.consolidated\.ckpt)?$": (
        "tests/unit/checkpoint/test_checkpoint_safety.py", ('main(["consolidate", str(tmp_path / "ok.ckpt")',),
    ),
    r"python -m lightning_vitscale consolidate SRC$": (
        "tests/unit/checkpoint/test_verified.py", ('main(["consolidate", str(folder)])',),
    ),
    r"python -m lightning_vitscale consolidate SRC DST --weights ema$": (
        "tests/distributed/test_ema.py", ('"--weights", "ema"]) == 0',),
    ),
    r"python -m lightning_vitscale consolidate --from fsdp1 \S+ \S+$": (
        "tests/distributed/test_fsdp1_checkpoints.py", ('main(["consolidate", "--from", "fsdp1", str(',),
    ),
    r"python -m lightning_vitscale consolidate --from fsdp1-local --model \S+ \S+ \S+$": (
        "tests/distributed/test_fsdp1_checkpoints.py",
        ('main(["consolidate", "--from", "fsdp1-local", "--model", LOCAL',),
    ),
    # Export (docs/export.md): each format, loaded strictly by its own library in tests/unit/checkpoint/test_export.py.
    r"python -m lightning_vitscale export SRC DST --module backbone --weights teacher$": (
        "tests/unit/checkpoint/test_export.py", ('"--module", module, "--weights", weights]) == 0',),
    ),
    r"python -m lightning_vitscale export SRC DST --module backbone --weights teacher --dtype bf16$": (
        "tests/unit/checkpoint/test_export.py", ('"--weights", "teacher", "--module", "backbone", "--dtype", "bf16"]',),
    ),
    r"python -m lightning_vitscale export SRC DST --format timm --weights teacher --module backbone"
    r" --arch vit_tiny_patch16_224 --arch-args JSON$": (
        "tests/unit/checkpoint/test_export.py",
        ('"--format", "timm", "--weights", "teacher", "--module", "backbone",', '"--arch", "vit_tiny_patch16_224"'),
    ),
    r"python -m lightning_vitscale export SRC DST --format hf --module net --weights ema --model PKG\.MODULE:CLASS$": (
        "tests/unit/checkpoint/test_export.py", ('"--format", "hf", "--module", "net", "--weights", "ema",',),
    ),
    r"python -m lightning_vitscale export SRC DST --format torchvision --module net --arch squeezenet1_1"
    r" --arch-args JSON$": (
        "tests/unit/checkpoint/test_export.py", ('"--format", "torchvision", "--module", "net",',),
    ),
    # Multi-node launches, run on one machine as 2 "nodes" x 2 ranks (tests/distributed/test_hybrid.py) and as
    # SLURM tasks (tests/distributed/test_lifecycle.py) through these helpers.
    r"torchrun --nnodes[= ]\S+ (--nproc-per-node=\S+ )?--node-rank[= ]\S+": (
        "tests/helpers/launch.py", ('"-m", "torch.distributed.run", f"--nnodes={nodes}", f"--node-rank={node}"',),
    ),
    r"srun python train\.py$": ("tests/helpers/launch.py", ("def slurm_launch(", "SLURM_NTASKS_PER_NODE")),
}

NOT_RUN: dict[str, str] = {
    'pip install "lightning-vitscale[xformers]"': "xformers has CUDA kernels only; CI runs on CPU",
    'pip install --no-deps -e . && pip install "lightning>=2.5,<3" "torchmetrics>=1.4"': (
        "the route for a preinstalled torch (the GPU image); benchmarks/gpu_run.sh uses the tree with PYTHONPATH=."
    ),
}

_INLINE = re.compile(r"`((?:python|bash|torchrun|pip|srun) [^`]+)`")


def _block_commands(block: str) -> list[str]:
    joined = re.sub(r"\\\n\s*", " ", block)
    commands = []
    for line in joined.splitlines():
        line = line.split("  #")[0].split("    #")[0].strip()  # trailing comments
        if line and not line.startswith("#"):
            commands.append(" ".join(line.split()))
    return commands


def documented_commands() -> dict[str, str]:
    """Each command in README.md and docs/*.md -> the page it is on."""
    found: dict[str, str] = {}
    for page in PAGES:
        text = page.read_text()
        for block in re.findall(r"```(?:bash|sh|shell|console)\n(.*?)```", text, flags=re.S):
            for command in _block_commands(block):
                found.setdefault(command, page.name)
        for command in _INLINE.findall(re.sub(r"```.*?```", "", text, flags=re.S)):
            if " | " not in command:  # "demo | plan | consolidate" lists commands, each given on its own too
                found.setdefault(" ".join(command.split()), page.name)
    return found


def test_the_pages_give_commands():
    commands = documented_commands()
    assert TEST_COMMAND in commands and len(commands) >= 15, sorted(commands)


def test_every_documented_command_is_run_by_a_test_or_ci():
    unmatched = []
    for command, page in documented_commands().items():
        if command in NOT_RUN:
            continue
        rows = [pattern for pattern in RUN_BY if re.match(pattern, command)]
        if len(rows) != 1:
            unmatched.append(f"{page}: {command!r} matches {len(rows)} rows")
    assert not unmatched, (
        "a command in README.md/docs is run by no test or CI step (add the test, then a RUN_BY row naming it):\n"
        + "\n".join(unmatched)
    )


def test_each_row_still_runs_its_command():
    for pattern, (path, needles) in RUN_BY.items():
        text = (ROOT / path).read_text()
        for needle in needles:
            assert needle in text, f"{path} no longer holds {needle!r}, which runs the documented `{pattern}`"


def test_no_row_outlives_its_command():
    commands = documented_commands()
    stale = [p for p in RUN_BY if not any(re.match(p, c) for c in commands)]
    stale += [c for c in NOT_RUN if c not in commands]
    assert not stale, f"rows for commands no page gives any more: {stale}"


def _python_blocks() -> list[tuple[str, str]]:
    return [(page.name, block) for page in PAGES
            for block in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)]


def test_python_snippets_parse_import_what_exists_and_pass_real_options():
    """The python blocks are snippets (they use the reader's model); what can be checked without one is."""
    import ast
    import importlib
    import inspect

    from lightning_vitscale import VitScaleStrategy

    options = set(inspect.signature(VitScaleStrategy.__init__).parameters) - {"self"}
    blocks = _python_blocks()
    assert len(blocks) >= 8
    for page, block in blocks:
        tree = ast.parse(block)  # a SyntaxError names the snippet
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_vitscale"):
                module = importlib.import_module(node.module or "")
                missing = [a.name for a in node.names if not hasattr(module, a.name)]
                assert not missing, f"{page}: `from {node.module} import {missing}` fails"
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "VitScaleStrategy":
                unknown = {k.arg for k in node.keywords} - options
                assert not unknown, f"{page}: VitScaleStrategy({unknown}=...) is no option"


def _anchors(page: Path) -> set[str]:
    headings = [line.lstrip("#").strip().lower() for line in page.read_text().splitlines()
                if re.match(r"#{1,6} ", line)]
    return {re.sub(r"[^\w\- ]", "", h).replace(" ", "-") for h in headings}  # GitHub's heading ids


def test_links_between_the_pages_resolve():
    """The sections moved between README and docs/: every relative link and #anchor must still land."""
    broken = []
    for page in [*PAGES, ROOT / "benchmarks" / "RESULTS.md"]:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path = (page.parent / target) if target else page
            if not path.exists() or (anchor and path.suffix == ".md" and anchor not in _anchors(path)):
                broken.append(f"{page.relative_to(ROOT)}: ({target}#{anchor})")
    assert not broken, "links that land nowhere:\n" + "\n".join(broken)
