import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fastdata.cli import cli

from .conftest import snapshot


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_convert_info_verify_export(mixed_folder: Path, tmp_path: Path) -> None:
    dst, out = str(tmp_path / "s.lmdb"), str(tmp_path / "out")
    code, stdout, _ = run("convert", str(mixed_folder), dst, "--quiet", "--workers", "2")
    assert code == 0
    assert "9 images in 2 classes" in stdout
    assert "repaired (end-of-image marker appended): 1: a_class/missing_eoi.jpg" in stdout
    assert "skipped 3 unusable file(s)" in stdout and "a_class/empty.jpg" in stdout

    code, stdout, _ = run("info", dst)
    assert code == 0 and "images:     9" in stdout and "fastdata v1" in stdout
    code, stdout, _ = run("info", dst, "--json")
    facts = json.loads(stdout)
    assert facts["count"] == 9 and facts["images_per_class"] == {"a_class": 7, "b_class": 2}

    code, stdout, _ = run("verify", dst, "--decode", "--quiet")
    assert code == 0 and "9 records OK" in stdout

    code, stdout, _ = run("export", dst, out, "--quiet")
    assert code == 0 and "wrote 9 files" in stdout
    assert (
        snapshot(Path(out))["a_class/missing_eoi.jpg"]
        == (mixed_folder / "a_class" / "missing_eoi.jpg").read_bytes()
    )


def test_verify_lists_failures_and_exits_1(good_folder: Path, tmp_path: Path) -> None:
    import lmdb

    dst = tmp_path / "s.lmdb"
    assert run("convert", str(good_folder), str(dst), "-q")[0] == 0
    env = lmdb.open(str(dst), map_size=1 << 24)
    with env.begin(write=True) as txn:
        value = bytearray(txn.get(b"0000000002"))
        value[-10] ^= 0xFF  # flip bits inside the image bytes
        txn.put(b"0000000002", bytes(value))
    env.close()
    code, stdout, _ = run("verify", str(dst), "-q")
    assert code == 1
    assert "1 of 12 records failed" in stdout and "cat/002.jpg: checksum mismatch" in stdout


def test_errors_are_one_line_without_traceback(tmp_path: Path, good_folder: Path) -> None:
    code, _, stderr = run("info", str(tmp_path / "missing"))
    assert code != 0 and stderr.count("\n") == 1 and "Traceback" not in stderr
    assert "missing: no LMDB store here" in stderr
    code, _, stderr = run("convert", str(tmp_path / "nosrc"), str(tmp_path / "d"))
    assert code != 0 and "nosrc" in stderr and "Traceback" not in stderr
    dst = str(tmp_path / "s.lmdb")
    run("convert", str(good_folder), dst, "-q")
    code, _, stderr = run("convert", str(good_folder), dst, "-q")
    assert code == 2 and "--overwrite" in stderr


def test_export_refuses_names_outside_outdir(tmp_path: Path, good_folder: Path) -> None:
    import lmdb

    from fastdata.records import RecordHeader

    dst = tmp_path / "s.lmdb"
    run("convert", str(good_folder), str(dst), "-q")
    env = lmdb.open(str(dst), map_size=1 << 24)
    with env.begin(write=True) as txn:
        header = RecordHeader.from_json(txn.get(b"#0000000000"))
        evil = RecordHeader("../../escaped.jpg", 0, header.size, header.crc32, "jpeg")
        txn.put(b"#0000000000", evil.to_json())
    env.close()
    code, _, stderr = run("export", str(dst), str(tmp_path / "out"), "-q")
    assert code != 0 and "../../escaped.jpg" in stderr and "not a safe relative path" in stderr
    assert "nothing was written for it" in stderr
    assert not (tmp_path / "escaped.jpg").exists()
    assert not list(tmp_path.parent.glob("escaped.jpg"))


@pytest.mark.parametrize("command", ["convert", "info", "verify", "export", "bench"])
def test_every_command_has_help_with_example(command: str) -> None:
    code, stdout, _ = run(command, "--help")
    assert code == 0 and "Example:" in stdout and "fastdata " + command in stdout


def test_help_and_import_do_not_load_torch() -> None:
    code = (
        "import sys, fastdata; from fastdata import cli; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "fastdata", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "convert" in out.stdout
    assert " torch" not in out.stderr.replace("torch.", "")


def test_bench_reports_throughput_and_verdict(good_folder: Path, tmp_path: Path) -> None:
    dst = str(tmp_path / "s.lmdb")
    run("convert", str(good_folder), dst, "-q")
    plot = tmp_path / "workers.png"
    code, stdout, stderr = run(
        "bench", dst, "-b", "4", "--seconds", "0.2", "--step-ms", "0.01", "--plot", str(plot)
    )
    assert code == 0, stderr
    assert "raw reads:" in stdout and "decode+crop:" in stdout and "<- chosen" in stdout
    assert "input-bound" in stdout and "would wait" in stdout  # a 10 us step always waits
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:4] == b"\x89PNG"
    code, stdout, _ = run("bench", dst, "-b", "4", "--seconds", "0.2", "-j", "1", "--json")
    facts = json.loads(stdout)
    assert facts["chosen_workers"] == 1 and facts["records"] == 12
    assert facts["reads_per_s"] > 0 and facts["pipeline_per_s"] > 0
    assert set(facts["loader_per_s"]) >= {"1"}
    code, _, stderr = run("bench", dst, "-j", "lots")
    assert code != 0 and "--workers" in stderr
