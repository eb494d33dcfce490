"""`dflash demo` through click's CliRunner: the help text, and the refusals that protect an output folder."""

from click.testing import CliRunner

from cli.main import cli


def test_help():
    res = CliRunner().invoke(cli, ["demo", "--help"], prog_name="dflash")
    assert res.exit_code == 0, res.output
    assert "Usage: dflash demo" in res.output
    for opt in ("--output", "--conversations", "--steps", "--eval-prompts", "--fresh"):
        assert opt in res.output


def test_listed_in_main_help():
    res = CliRunner().invoke(cli, ["--help"], prog_name="dflash")
    assert res.exit_code == 0, res.output
    assert "demo" in res.output


def test_refuses_a_non_demo_folder(tmp_path):
    (tmp_path / "precious.txt").write_text("x")
    res = CliRunner().invoke(cli, ["demo", "--output", str(tmp_path), "--steps", "3"], prog_name="dflash")
    assert res.exit_code == 1
    assert "not a demo folder" in res.output and "--fresh" in res.output
    assert (tmp_path / "precious.txt").exists()


def test_refuses_other_settings(tmp_path):
    from dflash.demo import cpu_defaults, prepare_output

    prepare_output(cpu_defaults(output=str(tmp_path / "d"), steps=5), fresh=False)
    res = CliRunner().invoke(cli, ["demo", "--output", str(tmp_path / "d"), "--steps", "6"], prog_name="dflash")
    assert res.exit_code == 1
    assert "holds a demo run with" in res.output and "--fresh" in res.output


def test_bad_value():
    res = CliRunner().invoke(cli, ["demo", "--steps", "0"], prog_name="dflash")
    assert res.exit_code == 2
    assert "--steps" in res.output
