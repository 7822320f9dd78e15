"""The README's two commands are the ones CI and users run."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    """The ```sh blocks of the README's "Two commands" section, in order."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Two commands\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sh\n(.*?)\n```", section, re.S)


def ci_commands() -> list[str]:
    """The commands .ci/run runs in its fresh virtual environment, in order."""
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    return [ln.removesuffix(" || exit") for ln in lines if ln.startswith("pip install")]


def test_ci_runs_the_readme_commands_verbatim():
    readme, ci = readme_commands(), ci_commands()
    assert len(readme) == 2
    assert "kgen build kgen/specs/fused_bias_act.yaml" in readme[0] and "pytest" in readme[1]
    assert ci == readme
