"""The README's Python example runs as printed (its code block, executed as it stands)."""
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_python_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) == 1, "expected one ```python block in README.md"
    exec(compile(blocks[0], str(README), "exec"), {})
    stats = eval(capsys.readouterr().out)  # it prints the layer's denominator statistics
    assert stats["count"] == 8 * (1024 + 700 + 512 + 3)  # heads x the unpadded rows
