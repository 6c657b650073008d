"""Assertions shared by the CLI tests."""

from specpool.cli.main import EXIT_USAGE


def assert_one_line_error(code, err, *fragments):
    """Bad input: exit status 2, one 'specpool: error: ...' line naming the problem, no traceback."""
    assert code == EXIT_USAGE, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("specpool: error:"), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
