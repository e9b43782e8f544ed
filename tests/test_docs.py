"""The documentation's code runs: docstring examples, page code blocks, API page targets.

* Every ``Example:`` in the package's docstrings is run as a doctest (a module's
  ``__doctest_requires__`` names the optional packages its examples need: skipped without them).
* Every fenced ``python`` block of ``README.md`` and of the pages in ``docs/`` is run, the
  blocks of one page in order in one namespace (a page opts out with the line
  ``<!-- docs-test: skip -->``; illustrative snippets that should not run use another fence
  language, such as ``text``).
* Every ``::: module`` target of the API pages imports.

The strict site build itself (``mkdocs build --strict``) runs in ``scripts/run_tests.sh``.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import pkgutil
import re
from pathlib import Path

import pytest

import torchrl_flowpolicy

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PYTHON_BLOCK = re.compile(r"^```python[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
SKIP_PAGE = "<!-- docs-test: skip -->"

MODULES = sorted(
    info.name for info in pkgutil.walk_packages(torchrl_flowpolicy.__path__, "torchrl_flowpolicy.")
)
PAGES = sorted(
    str(path.relative_to(ROOT))
    for path in [ROOT / "README.md", *DOCS.rglob("*.md")]
    if PYTHON_BLOCK.search(path.read_text()) and SKIP_PAGE not in path.read_text()
)


def import_or_skip(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name and not error.name.startswith("torchrl_flowpolicy"):
            pytest.skip(f"{name} needs the optional package {error.name!r}")
        raise


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = import_or_skip(name)
    for requirement in getattr(module, "__doctest_requires__", ()):
        if importlib.util.find_spec(requirement) is None:
            pytest.skip(f"the examples of {name} need the optional package {requirement!r}")
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=flags)
    for test in finder.find(module, name, globs=vars(module).copy()):
        runner.run(test)
    results = runner.summarize(verbose=False)
    assert results.failed == 0, f"{results.failed} docstring example(s) of {name} failed (above)"


@pytest.mark.parametrize("page", PAGES)
def test_page_code_blocks(page):
    namespace: dict = {"__name__": f"docs_{Path(page).stem}"}
    for index, block in enumerate(PYTHON_BLOCK.findall((ROOT / page).read_text())):
        code = compile(block, f"{page} (python block {index})", "exec")
        exec(code, namespace)


def test_api_pages_name_importable_modules():
    targets = [
        match
        for path in DOCS.rglob("*.md")
        for match in re.findall(r"^::: ([\w.]+)", path.read_text(), re.MULTILINE)
    ]
    assert targets, "no API page found under docs/"
    for target in targets:
        importlib.import_module(target)


def test_ppo_page_lists_every_option_with_its_default(example, capsys):
    """The options table of docs/examples/ppo.md and ``examples/ppo.py --help`` agree."""
    ppo = example("ppo")
    with pytest.raises(SystemExit):
        ppo.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    options_text = help_text.split(" options: ", 1)[1]  # past the description
    listed = set(re.findall(r"(?:^| )(--[\w.]+)(?=[ ,])", options_text))
    listed -= {"--help", "--no-resume"}
    page = (DOCS / "examples" / "ppo.md").read_text()
    rows = re.findall(r"^\| `(--[\w.]+)` \|([^|]*)\|([^|]*)\|", page, re.MULTILINE)
    table = {flag: (default.strip(), quick.strip()) for flag, default, quick in rows}
    assert set(table) == listed
    for flag, (default, quick) in table.items():
        if flag != "--quick":  # the first default after the option is its own
            shown = re.search(re.escape(flag) + r"[ ,].*?\(default: ([^;)]*)", options_text)
            assert shown is not None and shown.group(1) == default, flag
        if quick:
            assert ppo.QUICK[flag.removeprefix("--")] == type(ppo.QUICK[flag[2:]])(quick), flag


#: The manual's pages stay short; the API reference and the experiments (the record of every
#: run) may be as long as they need.
MAX_PAGE_LINES = 300
LONG_SECTIONS = ("api", "experiments")


def test_manual_pages_are_at_most_300_lines():
    pages = [
        path for path in DOCS.rglob("*.md") if path.relative_to(DOCS).parts[0] not in LONG_SECTIONS
    ]
    assert len(pages) > 10, pages
    long_pages = {
        str(path.relative_to(ROOT)): count
        for path in pages
        if (count := len(path.read_text().splitlines())) > MAX_PAGE_LINES
    }
    assert not long_pages, (
        f"over {MAX_PAGE_LINES} lines (history goes to docs/experiments/): {long_pages}"
    )


def test_readme_first_code_block_starts_within_its_first_40_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    first = next(index for index, line in enumerate(lines, start=1) if line.startswith("```"))
    assert first <= 40, f"README.md's first code block starts on line {first}"


def test_every_result_in_the_results_tables_links_to_its_experiment():
    """A table cell of docs/results.md that states a rate or a count of env steps does so inside
    a link to the experiment page (and section) that measured it."""
    page = (DOCS / "results.md").read_text()
    text_outside_code = re.sub(r"^```.*?^```", "", page, flags=re.MULTILINE | re.DOTALL)
    rows = [line for line in text_outside_code.splitlines() if line.startswith("| ")]
    assert len(rows) > 20, "docs/results.md has lost its tables"
    link = re.compile(r"\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(([^)]+)\)")
    unlinked, targets = [], set()
    for row in rows:
        targets.update(match[2] for match in link.finditer(row))
        for cell in row.strip("|").split("|")[1:]:  # the first cell names the row
            bare = link.sub("", cell)
            if re.search(r"\d %|\d+(\.\d+)?[kM]\b|\d,\d{3}", bare):
                unlinked.append(cell.strip())
    assert not unlinked, f"numbers without a link to their experiment: {unlinked}"
    assert targets and all(target.startswith("experiments/") for target in targets), targets
    for target in targets:
        assert (DOCS / target.split("#")[0]).is_file(), target
