"""The tuners: which experiment of a list runs next, given the results so far.

All three share DeepSpeed's loop: run one experiment at a time, at most `tuner_num_trials`, and
stop early once `tuner_early_stopping` experiments have run counting from the best one (the best
one included) without a better result. An experiment that failed scores as the worst result.

- gridsearch: the list's order.
- random: a seeded permutation.
- model_based: DeepSpeed fits an XGBoost ranking model over the explored configs; xgboost is no
  dependency here, so the cost model is our own: ridge regression (numpy least squares) of the
  score over the experiments' numeric features (stage, offload, checkpointing, micro-batch, gas,
  ZeRO sub-knobs; constant ones dropped, wide-ranged ones on a log scale, all standardised):
  linear while the results are fewer than the quadratic expansion's terms, quadratic after (fewer
  points than terms interpolate wildly; on a replayed noisy CPU table this took the mean pick from
  0.85 to 0.93 of the best in 6 trials). Two seed experiments (the first and a random one), then each
  next experiment is the unvisited one the model ranks best, or, one time in five, a random
  unvisited one (DeepSpeed's exploration ratio) so the model cannot lock onto a bad region."""
from __future__ import annotations

import math
import random
from typing import Any, Callable, Optional

import numpy as np

from deepspeed_c.autotuning.space import CKPT_KEY

INIT_NUM = 2
EXPLORATION = 0.2
RIDGE = 1e-2


def score(value: Optional[float], metric: str) -> float:
    """Higher is better: throughput and flops as measured, latency inverted; a failure is 0."""
    if value is None or not math.isfinite(value) or value <= 0:
        return 0.0
    return 1.0 / value if metric == "latency" else float(value)


def _flatten(prefix: str, d: dict[str, Any], out: dict[str, float]) -> None:
    for k, v in d.items():
        if isinstance(v, dict):
            _flatten(f"{prefix}{k}.", v, out)
        elif isinstance(v, (bool, int, float)):
            out[prefix + k] = float(v)


def raw_features(exp: dict[str, Any]) -> dict[str, float]:
    ds = exp["ds_config"]
    out: dict[str, float] = {}
    _flatten("", {k: ds[k] for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")}, out)
    zero = dict(ds.get("zero_optimization") or {})
    out["offload"] = float(isinstance(zero.pop("offload_optimizer", None), dict))
    _flatten("zero.", zero, out)
    if CKPT_KEY in exp:
        out[CKPT_KEY] = float(bool(exp[CKPT_KEY]))
    return out


def feature_matrix(exps: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """Standardised numeric features, one row per experiment: (linear, quadratically expanded)."""
    rows = [raw_features(e) for e in exps]
    keys = sorted({k for r in rows for k in r})
    x = np.array([[r.get(k, 0.0) for k in keys] for r in rows], dtype=np.float64)
    if x.size == 0:
        return np.ones((len(exps), 1)), np.ones((len(exps), 1))
    cols = []
    for j in range(x.shape[1]):
        c = x[:, j]
        if np.all(c == c[0]):
            continue  # constant: carries nothing
        if np.all(c > 0) and c.max() / c.min() >= 8:
            c = np.log2(c)  # sizes spanning orders of magnitude
        cols.append((c - c.mean()) / (c.std() or 1.0))
    z = np.stack(cols, axis=1) if cols else np.zeros((len(exps), 0))
    quad = [z[:, i] * z[:, j] for i in range(z.shape[1]) for j in range(i, z.shape[1])]
    linear = np.column_stack([np.ones(len(exps)), z])
    return linear, (np.column_stack([linear, *quad]) if quad else linear)


class CostModel:
    """Ridge least squares on the feature rows: fit(rows seen, scores), predict(all rows)."""

    def __init__(self, ridge: float = RIDGE) -> None:
        self.ridge = ridge
        self.w: Optional[np.ndarray] = None

    def fit(self, x: np.ndarray, y: np.ndarray) -> None:
        scale = float(np.max(np.abs(y))) or 1.0
        a = x.T @ x + self.ridge * np.eye(x.shape[1])
        a[0, 0] -= self.ridge  # the intercept is not shrunk
        self.w = np.linalg.lstsq(a, x.T @ (y / scale), rcond=None)[0]

    def predict(self, x: np.ndarray) -> np.ndarray:
        return x @ self.w if self.w is not None else np.zeros(len(x))


class Tuner:
    """Runs experiments through `run(exp) -> metric or None` until the list, the trials or the
    patience runs out; `history` holds (exp, value) in run order."""

    def __init__(self, exps: list[dict[str, Any]], tuner_type: str, metric: str, num_trials: int,
                 early_stopping: Optional[int], seed: int = 0) -> None:
        self.exps, self.tuner_type, self.metric = list(exps), tuner_type, metric
        self.num_trials, self.early_stopping = num_trials, early_stopping
        self.rng = random.Random(seed)
        self.history: list[tuple[dict[str, Any], Optional[float]]] = []
        self.best_index: Optional[int] = None
        self._order: list[int] = list(range(len(self.exps)))
        if tuner_type == "random":
            self.rng.shuffle(self._order)
        elif tuner_type == "model_based":
            self._x_lin, self._x_quad = feature_matrix(self.exps) if self.exps else (None, None)
            self._model = CostModel()
        elif tuner_type != "gridsearch":
            raise ValueError(f"autotuning.tuner_type {tuner_type!r}: expected gridsearch, random or model_based")
        self._visited: set[int] = set()

    def _next_model_based(self) -> int:
        unvisited = [i for i in range(len(self.exps)) if i not in self._visited]
        if len(self._visited) < INIT_NUM:
            return 0 if 0 in unvisited else self.rng.choice(unvisited)
        if self.rng.random() < EXPLORATION:
            return self.rng.choice(unvisited)
        seen = sorted(self._visited)
        x = self._x_quad if len(seen) > self._x_quad.shape[1] else self._x_lin
        y = np.array([score(self._values[i], self.metric) for i in seen])
        self._model.fit(x[seen], y)
        pred = self._model.predict(x[unvisited])
        return unvisited[int(np.argmax(pred))]  # ties: the earliest in grid order

    def next_index(self) -> Optional[int]:
        if len(self._visited) >= len(self.exps):
            return None
        if self.tuner_type == "model_based":
            return self._next_model_based()
        return next(i for i in self._order if i not in self._visited)

    def _better(self, a: Optional[float], b: Optional[float]) -> bool:
        return a is not None and (b is None or (a < b if self.metric == "latency" else a > b))

    def tune(self, run: Callable[[dict[str, Any]], Optional[float]]) -> int:
        self._values: dict[int, Optional[float]] = {}
        while len(self.history) < self.num_trials:
            i = self.next_index()
            if i is None:
                break
            value = run(self.exps[i])
            self._visited.add(i)
            self._values[i] = value
            best = self.history[self.best_index][1] if self.best_index is not None else None
            if self.best_index is None or self._better(value, best):
                self.best_index = len(self.history)
            self.history.append((self.exps[i], value))
            if self.early_stopping and len(self.history) >= self.best_index + self.early_stopping:
                break
        return len(self.history)
