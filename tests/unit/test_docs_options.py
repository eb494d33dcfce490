"""Every option of every command is explained in docs/: on a page that shows that command (`dflash COMMAND`
in its text), under one of the option's names. `dflash demo` is left out: its page is the README's "Try it",
which names its main options and points to `dflash demo --help` for the rest."""

import pathlib
import re

from cli.main import cli

ROOT = pathlib.Path(__file__).parents[2]
PAGES = {p.name: p.read_text() for p in (ROOT / "docs").glob("*.md") if p.name != "results.md"}


def commands():
    for name, cmd in cli.commands.items():
        for sub, c in (cmd.commands.items() if hasattr(cmd, "commands") else [("", cmd)]):
            yield " ".join(filter(None, ("dflash", name, sub))), c


def test_every_option_is_on_a_page_of_its_command():
    missing = []
    for full, cmd in commands():
        if full == "dflash demo":
            continue
        pages = [text for text in PAGES.values() if full in text]
        assert pages, f"no page of docs/ shows `{full}`"
        named = set(re.findall(r"--[a-z][a-z0-9-]*", "\n".join(pages)))
        for param in cmd.params:
            names = [o for o in (*param.opts, *param.secondary_opts) if o.startswith("--")]
            if names and not set(names) & named:
                missing.append(f"{full} {'/'.join(names)}")
    assert not missing, "options no docs/ page of their command explains: " + ", ".join(missing)
