"""dsc_nvme_tune: DeepSpeed's ds_nvme_tune flags, a sweep on this machine's disk, and the written
`aio` section being one of the swept configurations that the config parser accepts."""
from __future__ import annotations

import json

import pytest

from deepspeed_c.nvme import tune
from deepspeed_c.runtime.config import DeepSpeedConfig


def test_sweep_writes_a_valid_aio_section(tmp_path, capsys):
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"block_size": ["64K", "256K"], "io_parallel": [1, 2]}))
    logs = tmp_path / "logs"
    tune.cli_main(["--nvme_dir", str(tmp_path), "--io_size", "1M", "--loops", "1", "--sweep_config", str(sweep),
                   "--log_dir", str(logs)])
    results = json.loads((logs / "sweep_results.json").read_text())
    assert len(results) == 4 and all(r["read"] > 0 and r["write"] > 0 for r in results)
    section = json.loads((logs / "aio_config.json").read_text())["aio"]
    fastest = max(results, key=lambda r: r["read"])["config"]
    assert section["block_size"] == tune.parse_size(fastest["block_size"])
    assert section["intra_op_parallelism"] == fastest["io_parallel"]
    cfg = DeepSpeedConfig({"train_batch_size": 1, "aio": section}).aio_config
    assert cfg["block_size"] == section["block_size"]
    assert '"aio"' in capsys.readouterr().out
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".swp"]  # its test files are removed


def test_flags():
    assert tune.parse_size("400M") == 400 << 20 and tune.parse_size("1G") == 1 << 30 and tune.parse_size(4096) == 4096
    with pytest.raises(SystemExit):
        tune.parse_sweep_arguments(["--nvme_dir", "/tmp", "--gds"])
    with pytest.raises(SystemExit):
        tune.parse_sweep_arguments(["--nvme_dir", "/tmp", "--no_read", "--no_write"])
    args = tune.parse_sweep_arguments(["--nvme_dir", "/a", "/b", "--no_write", "--loops", "3"])
    assert args.nvme_dir == ["/a", "/b"] and args.no_write and args.loops == 3 and args.io_size == "400M"
