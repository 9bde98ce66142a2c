"""Option errors: one line naming the option and the allowed values, exit 2, nothing run."""
import os

import pytest

from conftest import EXAMPLES, run_cli, run_folders

MLP = os.path.join(EXAMPLES, "mlp.py")


@pytest.mark.parametrize("args,needle", [
    (["--events=alloc,bogus"], "--events"),
    (["--analysis=leak"], "--analysis"),
    (["--analysis=oom:0"], "--analysis"),
    (["--analysis=leaks:3"], "--analysis"),
    (["--steps=1,2,3,4,5,6"], "--steps"),
    (["--steps=x"], "--steps"),
    (["--call-stack=python:2000"], "--call-stack"),
    (["--call-stack=java"], "--call-stack"),
    (["--level=warp"], "--level"),
    (["--device=tpu"], "--device"),
    (["--data-format=xml"], "--data-format"),
    (["--collect-mode=lazy"], "--collect-mode"),
    (["--log-level=loud"], "--log-level"),
    (["--watch=a,b,c,d"], "--watch"),
    (["--bogus"], "--bogus"),
    (["--compare"], "--compare"),
    (["--compress=gzip"], "--compress"),
    (["--compress=zstd", "--data-format=db"], "--compress"),
    (["--keep-steps=many"], "--keep-steps"),
])
def test_bad_option(out_dir, args, needle):
    r = run_cli(["-o", str(out_dir), *args, MLP, "--steps", "1"])
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("msmemscope: error:"), r.stderr
    assert needle in lines[0]
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert run_folders(out_dir) == []  # nothing ran


def test_missing_program_and_no_program(out_dir):
    r = run_cli(["-o", str(out_dir), "no_such_script.py"])
    assert r.returncode == 2 and "no_such_script.py" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run_cli(["-o", str(out_dir)])
    assert r.returncode == 2 and "no program" in r.stderr


def test_unwritable_output(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = run_cli(["-o", str(blocker / "sub"), MLP])
    assert r.returncode == 2 and "--output" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_version_and_help():
    r = run_cli(["-V"])
    assert r.returncode == 0 and r.stdout.startswith("msmemscope ")
    r = run_cli(["--help"])
    assert r.returncode == 0 and "--analysis" in r.stdout and "--watch" in r.stdout
    from msmemscope.cli import SUBCOMMANDS
    for sub in SUBCOMMANDS:  # every subcommand has its help (show took --help for a path)
        for flag in ("-h", "--help"):
            r = run_cli([sub, flag])
            assert r.returncode == 0 and r.stdout.startswith("usage: msmemscope") and not r.stderr, (sub, flag, r)


def test_config_rejects_bad_values():
    import msmemscope
    with pytest.raises(msmemscope.OptionError, match="--events"):
        msmemscope.config(events="nope")
    with pytest.raises(msmemscope.OptionError, match="unknown option"):
        msmemscope.config(colour="red")
    with pytest.raises(msmemscope.OptionError, match="--keep-steps"):
        msmemscope.config(keep_steps="x")
    for bad in ("zstd:40", "zstd:x", "lz4"):
        with pytest.raises(msmemscope.OptionError, match="--compress"):
            msmemscope.config(compress=bad)
    with pytest.raises(msmemscope.OptionError, match="--keep-steps"):
        msmemscope.config(keep_steps=-3)
    from msmemscope.options import build
    o = build(compress="zstd", keep_steps=50)
    assert (o.compress, o.keep_steps) == ("zstd:3", 50) and build(compress="zstd:19").compress == "zstd:19"
    assert build(keep_steps="all").keep_steps == 0 and build(compress="none").compress == "none"
