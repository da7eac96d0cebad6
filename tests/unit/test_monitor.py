"""Monitor config sections and backends: TensorBoard event files read back with tensorboard's
EventAccumulator, CSV files read back with the csv module, rank-0-only writing, and the optional
backends (wandb, comet, trackio) failing clearly when their package is missing."""
from __future__ import annotations

import csv
import json
import math
import sys
import types

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from deepspeed_c.monitor.comet import EventsLogScheduler
from deepspeed_c.monitor.config import (CometConfig, CSVConfig, DeepSpeedMonitorConfig, TensorBoardConfig,
                                        WandbConfig, get_monitor_config)
from deepspeed_c.monitor.csv_monitor import csvMonitor
from deepspeed_c.monitor.monitor import MonitorMaster
from deepspeed_c.monitor.tensorboard import TensorBoardMonitor
from deepspeed_c.monitor.utils import MonitorBackendUnavailable

EVENTS = [[("Train/Samples/train_loss", 2.5 / (i + 1), 8 * (i + 1)), ("Train/Samples/lr", 1e-3 * (i + 1), 8 * (i + 1))]
          for i in range(5)]


@pytest.fixture(autouse=True)
def rank0(monkeypatch):
    monkeypatch.setenv("RANK", "0")


# --- config -------------------------------------------------------------------------------------

def test_config_defaults_are_deepspeeds():
    cfg = get_monitor_config({})
    assert not cfg.enabled
    assert (cfg.tensorboard.enabled, cfg.tensorboard.output_path, cfg.tensorboard.job_name) == (
        False, "", "DeepSpeedJobName")
    assert (cfg.csv_monitor.enabled, cfg.csv_monitor.output_path, cfg.csv_monitor.job_name) == (
        False, "", "DeepSpeedJobName")
    assert (cfg.wandb.enabled, cfg.wandb.group, cfg.wandb.team, cfg.wandb.project) == (False, None, None, "deepspeed")
    c = cfg.comet
    assert (c.enabled, c.samples_log_interval, c.project, c.workspace, c.api_key, c.experiment_name,
            c.experiment_key, c.online, c.mode) == (False, 100, None, None, None, None, None, None, None)
    assert (cfg.trackio.enabled, cfg.trackio.project) == (False, "deepspeed")


def test_config_enabled_when_any_section_is():
    for section in ("tensorboard", "wandb", "csv_monitor", "comet", "trackio"):
        assert get_monitor_config({section: {"enabled": True}}).enabled
    cfg = get_monitor_config({"csv_monitor": {"enabled": True, "output_path": "/o", "job_name": "j"},
                              "train_batch_size": 8})
    assert (cfg.csv_monitor.output_path, cfg.csv_monitor.job_name) == ("/o", "j")


@pytest.mark.parametrize("section, message", [
    ({"tensorboard": {"outptu_path": "x"}}, "unknown key 'tensorboard.outptu_path'; did you mean 'output_path'"),
    ({"csv_monitor": {"job": "x"}}, "unknown key 'csv_monitor.job'; did you mean 'job_name'"),
    ({"wandb": {"entity": "x"}}, "unknown key 'wandb.entity'"),
    ({"comet": {"samples_log_intervals": 5}}, "did you mean 'samples_log_interval'"),
    ({"wandb": {"enabled": "perhaps"}}, "wandb.enabled"),
    ({"comet": {"mode": "sometimes"}}, "comet.mode"),
    ({"comet": {"experiment_key": "short"}}, "comet.experiment_key"),
    ({"comet": {"samples_log_interval": 0}}, "comet.samples_log_interval"),
    ({"tensorboard": ["enabled"]}, "'tensorboard' must be a JSON object"),
])
def test_config_errors_name_the_key(section, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        get_monitor_config(section)


def test_section_models_standalone():
    assert TensorBoardConfig(enabled=True).job_name == "DeepSpeedJobName"
    assert CometConfig(experiment_key="a" * 32, mode="get").experiment_key == "a" * 32
    with pytest.raises(ValueError):
        CSVConfig(enabled=True, extra_key=1)


# --- TensorBoard --------------------------------------------------------------------------------

def test_tensorboard_events_read_back(tmp_path):
    cfg = get_monitor_config({"tensorboard": {"enabled": True, "output_path": str(tmp_path), "job_name": "run1"}})
    monitor = MonitorMaster(cfg)
    for events in EVENTS:
        monitor.write_events(events)
    monitor.write_events([("Train/Samples/loss_scale", torch.tensor(65536.0), 48)])  # 0-d tensors accepted
    monitor.update_config({"train_batch_size": 8})
    monitor.tb_monitor.close()

    log_dir = tmp_path / "run1"
    assert any(p.name.startswith("events.out.tfevents") for p in log_dir.iterdir())
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/loss_scale"}
    for tag, column in (("Train/Samples/train_loss", 0), ("Train/Samples/lr", 1)):
        got = [(s.step, s.value) for s in acc.Scalars(tag)]
        want = [(ev[column][2], ev[column][1]) for ev in EVENTS]
        assert [s for s, _ in got] == [s for s, _ in want]
        for (_, g), (_, w) in zip(got, want):
            assert math.isclose(g, w, rel_tol=1e-6)  # stored as float32
    assert [(s.step, s.value) for s in acc.Scalars("Train/Samples/loss_scale")] == [(48, 65536.0)]
    text = acc.Tensors("DeepSpeed/config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(text) == {"train_batch_size": 8}


def test_tensorboard_default_output_path_is_launch_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monitor = TensorBoardMonitor(TensorBoardConfig(enabled=True))
    monitor.write_events([("a", 1.0, 1)])
    monitor.close()
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "DeepSpeedJobName").iterdir())


# --- CSV ----------------------------------------------------------------------------------------

def test_csv_files_read_back(tmp_path):
    cfg = get_monitor_config({"csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "job"}})
    monitor = MonitorMaster(cfg)
    for events in EVENTS:
        monitor.write_events(events)
    monitor.write_events([("Eval/my metric", torch.tensor(0.5, dtype=torch.float64), 99)])
    monitor.update_config({"train_batch_size": 8, "steps_per_print": 10})

    job = tmp_path / "job"
    assert sorted(p.name for p in job.iterdir()) == ["Eval_my_metric.csv", "Train_Samples_lr.csv",
                                                     "Train_Samples_train_loss.csv", "deepspeed_config.csv"]
    for name, header, column in (("Train_Samples_train_loss.csv", "train_loss", 0), ("Train_Samples_lr.csv", "lr", 1)):
        with open(job / name, newline="") as fd:
            rows = list(csv.reader(fd))
        assert rows[0] == ["step", header]
        assert [(int(s), float(v)) for s, v in rows[1:]] == [(ev[column][2], ev[column][1]) for ev in EVENTS]
    with open(job / "Eval_my_metric.csv", newline="") as fd:
        assert list(csv.reader(fd)) == [["step", "my metric"], ["99", "0.5"]]
    with open(job / "deepspeed_config.csv", newline="") as fd:
        assert list(csv.reader(fd)) == [["key", "value"], ["train_batch_size", "8"], ["steps_per_print", "10"]]


def test_csv_resumed_run_appends_without_second_header(tmp_path):
    cfg = CSVConfig(enabled=True, output_path=str(tmp_path), job_name="j")
    csvMonitor(cfg).write_events([("Train/Samples/lr", 0.1, 1)])
    csvMonitor(cfg).write_events([("Train/Samples/lr", 0.2, 2)])
    with open(tmp_path / "j" / "Train_Samples_lr.csv", newline="") as fd:
        assert list(csv.reader(fd)) == [["step", "lr"], ["1", "0.1"], ["2", "0.2"]]


def test_only_rank_zero_writes(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    # a process group another test of this worker left initialised (world of one) would say rank 0
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    cfg = get_monitor_config({"csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "j"},
                              "tensorboard": {"enabled": True, "output_path": str(tmp_path), "job_name": "t"}})
    monitor = MonitorMaster(cfg)
    monitor.write_events(EVENTS[0])
    assert monitor.enabled and monitor.csv_monitor is None and monitor.tb_monitor is None
    assert list(tmp_path.iterdir()) == []


# --- optional backends --------------------------------------------------------------------------

@pytest.mark.parametrize("section, module", [("wandb", "wandb"), ("comet", "comet_ml"), ("trackio", "trackio")])
def test_missing_package_raises_naming_the_section(monkeypatch, section, module):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    with pytest.raises(MonitorBackendUnavailable, match=f"'{section}' section .* '{module}' package") as info:
        MonitorMaster(get_monitor_config({section: {"enabled": True}}))
    assert isinstance(info.value, ImportError)


def test_disabled_backends_are_never_imported(monkeypatch):
    for module in ("wandb", "comet_ml", "trackio"):
        monkeypatch.setitem(sys.modules, module, None)
    monitor = MonitorMaster(get_monitor_config({}))
    monitor.write_events(EVENTS[0])
    assert not monitor.enabled


def test_comet_version_floor(monkeypatch):
    monkeypatch.setitem(sys.modules, "comet_ml", types.SimpleNamespace(__version__="3.40.9"))
    with pytest.raises(MonitorBackendUnavailable, match="comet_ml >= 3.41.0, found 3.40.9"):
        MonitorMaster(get_monitor_config({"comet": {"enabled": True}}))


class _Recorder:
    """Stands in for an installed tracking package; records the calls made to it."""

    def __init__(self, version: str = "9.9.9") -> None:
        self.__version__ = version
        self.calls: list[tuple] = []
        recorder = self

        class Config:
            def update(self, d, allow_val_change=False):
                recorder.calls.append(("config", d, allow_val_change))

        class Experiment:
            def set_name(self, name):
                recorder.calls.append(("set_name", name))

            def log_metric(self, name, value, step=None):
                recorder.calls.append(("metric", name, value, step))

            def log_parameters(self, d):
                recorder.calls.append(("parameters", d))

        self.config = Config()
        self._experiment = Experiment()

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))

    def log(self, data, step=None, commit=None):
        self.calls.append(("log", data, step))

    def start(self, **kwargs):
        self.calls.append(("start", kwargs))
        return self._experiment


def test_wandb_events_and_config(monkeypatch):
    fake = _Recorder()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monitor = MonitorMaster(get_monitor_config({"wandb": {"enabled": True, "team": "t", "group": "g"}}))
    monitor.write_events([("Train/Samples/lr", 0.5, 16), ("Train/Samples/train_loss", torch.tensor(1.5), 16)])
    monitor.update_config({"a": 1})
    assert fake.calls == [("init", {"project": "deepspeed", "group": "g", "entity": "t"}),
                          ("log", {"Train/Samples/lr": 0.5}, 16), ("log", {"Train/Samples/train_loss": 1.5}, 16),
                          ("config", {"a": 1}, True)]


def test_comet_logs_every_samples_log_interval(monkeypatch):
    fake = _Recorder(version="3.41.0")
    monkeypatch.setitem(sys.modules, "comet_ml", fake)
    cfg = get_monitor_config({"comet": {"enabled": True, "samples_log_interval": 100, "project": "p",
                                        "experiment_name": "exp"}})
    monitor = MonitorMaster(cfg)
    for samples in (0, 50, 99, 100, 150, 230):
        monitor.write_events([("loss", float(samples), samples)])
    assert fake.calls[0] == ("start", {"api_key": None, "project": "p", "workspace": None, "experiment_key": None,
                                       "mode": None, "online": None})
    assert fake.calls[1] == ("set_name", "exp")
    assert [c[3] for c in fake.calls if c[0] == "metric"] == [0, 100, 230]


def test_events_log_scheduler_is_per_metric():
    sched = EventsLogScheduler(10)
    decisions = [sched.needs_logging(name, s) for name, s in
                 [("a", 0), ("b", 5), ("a", 9), ("b", 14), ("a", 10), ("b", 15), ("a", 19), ("a", 20)]]
    assert decisions == [True, True, False, False, True, True, False, True]


def test_monitor_config_is_a_pydantic_model():
    assert isinstance(get_monitor_config({}), DeepSpeedMonitorConfig)
    assert WandbConfig.model_json_schema()["properties"]["project"]["default"] == "deepspeed"
