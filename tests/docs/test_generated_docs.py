"""The documentation's generated parts match the code and the result files: every generated region of README.md and
docs/ (the CLI, topics, events, settings, benchmark tables) is what `forge-stream docs generate` writes now; every
result file under benchmarks/results/ says what produced it and has a page; `docs record` keeps a run with its
command, commit and machine. `.ci/run` builds the site itself with `mkdocs build --strict`."""

import json
import subprocess
from pathlib import Path

from typer.testing import CliRunner

from forge_stream.cli import app
from forge_stream.cli.docs import REGION, load_results, pages, render

REPO = Path(__file__).resolve().parents[2]
SETUP = "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[dev]' && forge-stream up"
TESTS = ". .venv/bin/activate && python -m pytest -q"


def test_every_generated_region_is_up_to_date():
    stale = [str(page.relative_to(REPO)) for page in pages(REPO) if render(REPO, page.read_text()) != page.read_text()]
    assert not stale, f"out of date: {stale}; run `forge-stream docs generate`"


def test_the_reference_pages_are_generated_from_the_code():
    for page, region in (("cli", "cli"), ("topics", "topics"), ("events", "events"), ("settings", "settings")):
        text = (REPO / "docs" / "reference" / f"{page}.md").read_text()
        assert any(m["spec"] == region for m in REGION.finditer(text)), page
    cli = (REPO / "docs" / "reference" / "cli.md").read_text()
    assert "### `forge-stream rollout run`" in cli and "`--agent-workers <int>`" in cli


def test_every_result_file_says_what_produced_it_and_has_a_page():
    results = load_results(REPO)
    assert results
    for result in results:
        assert {"benchmark", "variant", "command", "commit", "date", "machine", "summary", "result"} <= result.keys(), \
            result["file"]
        assert {"cores", "cpu_model"} <= result["machine"].keys(), result["file"]
        assert result["summary"] and result["result"] is not None, result["file"]
        page = (REPO / "docs" / "benchmarks" / f"{result['benchmark']}.md").read_text()
        kind = " exploratory" if result["exploratory"] else ""
        shown_on = page if not kind else (REPO / "docs" / "benchmarks" / "exploratory.md").read_text()
        assert f"<!-- generated: results {result['benchmark']}{kind} -->" in shown_on, result["file"]


def test_the_readme_keeps_the_two_set_up_commands():
    readme = (REPO / "README.md").read_text()
    assert f"```bash\n{SETUP}\n```" in readme
    assert f"```bash\n{TESTS}\n```" in readme


def test_docs_record_keeps_a_run_with_its_command_commit_and_machine(tmp_path):
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "benchmarks").mkdir(parents=True)
    page = tmp_path / "docs" / "benchmarks" / "codec.md"
    page.write_text("# Codec\n\n<!-- generated: results codec -->\n<!-- end generated -->\n")
    (tmp_path / "README.md").write_text("# x\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([*git, "add", "README.md"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-qm", "x"], cwd=tmp_path, check=True)
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"avro_bytes": 17400}))

    result = CliRunner().invoke(app, ["docs", "record", str(run), "--benchmark", "codec", "--root", str(tmp_path),
                                      "--command", "forge-stream bench codec --json", "--summary", "Avro 17.4 KB"])

    assert result.exit_code == 0, result.output
    [kept] = load_results(tmp_path)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    assert kept["commit"] == head and kept["command"] == "forge-stream bench codec --json"
    assert kept["machine"]["cores"] >= 1 and kept["result"] == {"avro_bytes": 17400} and kept["date"]
    assert f"[raw run](results/{kept['file']})" in page.read_text()
    # a second run at the same commit is kept beside the first; a run made at an earlier commit says so
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "docs only"], cwd=tmp_path, check=True)
    for extra in ([], [], ["--commit", head]):
        result = CliRunner().invoke(app, ["docs", "record", str(run), "--benchmark", "codec", "--root",
                                          str(tmp_path), "--command", "c", "--summary", "s", *extra])
        assert result.exit_code == 0, result.output
    kept = load_results(tmp_path)
    assert len(kept) == 4 and len({k["file"] for k in kept}) == 4
    assert sorted(k["commit"] for k in kept).count(head) == 2
    result = CliRunner().invoke(app, ["docs", "record", str(run), "--benchmark", "codec", "--root", str(tmp_path),
                                      "--command", "c", "--summary", "s", "--commit", "nope"])
    assert result.exit_code == 2 and "not a commit" in result.output


def test_every_benchmark_page_leads_with_its_current_result():
    """Under its title, before what it measures and before every run's row: the result a reader came for."""
    for result in load_results(REPO):
        if result["exploratory"] or not result.get("headline"):
            continue
        page = (REPO / "docs" / "benchmarks" / f"{result['benchmark']}.md").read_text()
        title, first = page.split("\n\n", 1)
        assert title.startswith("# ") and first.startswith(f"<!-- generated: current {result['benchmark']} -->")
        lead = first.split("<!-- end generated -->")[0]
        assert result["headline"] in lead and f"(results/{result['file']})" in lead, result["file"]
        table = page[page.index(f"<!-- generated: results {result['benchmark']} -->"):]
        row = next(line for line in table.splitlines() if f"(results/{result['file']})" in line)
        assert "**current**" in row and len(row.split(" | ")) == 4  # four columns: run, what ran, result, target


def test_the_readme_keeps_to_250_lines():
    """The README is a user's first page: what it does and how to use it; the rest is on the documentation site."""
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move detail to docs/"
