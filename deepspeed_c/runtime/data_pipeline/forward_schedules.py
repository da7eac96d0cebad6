"""The schedules that hand values to the model's forward while training, as DeepSpeed 0.19.6's engine does:

- the legacy seqlen curriculum: before each training forward, the scheduler moves to step global_steps + 1
  and the forward gets `curriculum_seqlen=<difficulty>`;
- progressive layer drop: each training forward gets `progressive_layer_drop=True, pld_theta=<theta>`; theta
  is updated at each gradient-accumulation boundary with the step count before the optimizer step
  advances it;
- random-LTD (data_efficiency.data_routing.random_ltd): before each training forward the scheduler moves to
  global_steps; the RandomLayerTokenDrop wrappers read its kept length (nothing is passed to forward).

Built from the config alone; the engine calls `forward_kwargs` and `at_boundary` and saves `state_dict`
with each checkpoint (DeepSpeed saves neither, so its resumed PLD restarts at theta 1.0; ours continues)."""
from __future__ import annotations

from typing import Any, Mapping, Optional, Union

from deepspeed_c.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler
from deepspeed_c.runtime.data_pipeline.data_routing.scheduler import RandomLTDScheduler
from deepspeed_c.runtime.progressive_layer_drop import ProgressiveLayerDrop


class ForwardSchedules:

    def __init__(self, curriculum_params: Union[dict, bool, None] = None, pld_theta: Optional[float] = None,
                 pld_gamma: float = 0.001, random_ltd: Optional[dict] = None) -> None:
        # 0.19.6's values: a floored ramp may fall below min_difficulty (0.19.8 raises it back)
        self.curriculum_scheduler: Optional[CurriculumScheduler] = (
            CurriculumScheduler(curriculum_params, key_path="curriculum_learning", raise_to_min_difficulty=False)
            if curriculum_params else None)
        self.progressive_layer_drop: Optional[ProgressiveLayerDrop] = (
            ProgressiveLayerDrop(theta=pld_theta, gamma=pld_gamma) if pld_theta is not None else None)
        # the section plus global_batch_size / micro_batch_size, as DeepSpeed's engine completes it
        self.random_ltd_config: Optional[dict] = random_ltd
        self.random_ltd_scheduler: Optional[RandomLTDScheduler] = (RandomLTDScheduler(random_ltd)
                                                                   if random_ltd else None)

    @classmethod
    def from_config(cls, config: Any) -> "ForwardSchedules":
        """From a DeepSpeedConfig: its curriculum_enabled_legacy/params and pld_enabled/pld_config."""
        curriculum = config.curriculum_params_legacy if config.curriculum_enabled_legacy else None
        pld = config.pld_config
        ltd = None
        if config.random_ltd_enabled:
            ltd = {**config.data_efficiency_config["data_routing"]["random_ltd"],
                   "global_batch_size": config.train_batch_size,
                   "micro_batch_size": config.train_micro_batch_size_per_gpu}
        return cls(curriculum, pld.theta if config.pld_enabled else None, pld.gamma, ltd)

    @property
    def active(self) -> bool:
        return self.curriculum_scheduler is not None or self.progressive_layer_drop is not None \
            or self.random_ltd_scheduler is not None

    def forward_kwargs(self, global_steps: int, curriculum: bool = True) -> dict[str, Any]:
        """The keywords a training forward at `global_steps` gets (the PipelineEngine passes curriculum=False:
        DeepSpeed does not inject the curriculum into a pipeline's forward)."""
        out: dict[str, Any] = {}
        if self.progressive_layer_drop is not None:
            out.update(self.progressive_layer_drop.get_state())
        if curriculum and self.curriculum_scheduler is not None:
            self.curriculum_scheduler.update_difficulty(global_steps + 1)
            out["curriculum_seqlen"] = self.curriculum_scheduler.get_current_difficulty()
        if self.random_ltd_scheduler is not None:
            self.random_ltd_scheduler.update_seq(global_steps)
        return out

    def at_boundary(self, global_steps: int) -> None:
        """A gradient-accumulation boundary, before the optimizer step increments `global_steps`."""
        if self.progressive_layer_drop is not None:
            self.progressive_layer_drop.update_state(global_steps)

    def set_custom_schedule(self, schedule: Any) -> None:
        """A custom legacy curriculum's function (a callable, or DeepSpeed's {metric: function} dict with one entry)."""
        if self.curriculum_scheduler is None:
            raise RuntimeError("set_custom_curriculum_learning_schedule: no curriculum is enabled (set "
                               "curriculum_learning.enabled with schedule_type 'custom')")
        if isinstance(schedule, Mapping):
            if len(schedule) != 1:
                raise ValueError(f"set_custom_curriculum_learning_schedule: the legacy curriculum has one metric "
                                 f"(seqlen); got functions for {sorted(schedule)}")
            schedule = next(iter(schedule.values()))
        if not callable(schedule):
            raise TypeError(f"set_custom_curriculum_learning_schedule: expected a function global_step -> difficulty, "
                            f"got {type(schedule).__name__}")
        self.curriculum_scheduler.set_custom_get_difficulty(schedule)

    def random_ltd_state_dict(self) -> Optional[dict[str, Any]]:
        """The model-states file's `random_ltd` (DeepSpeed's key and content); None when random-LTD is off."""
        return self.random_ltd_scheduler.state_dict() if self.random_ltd_scheduler is not None else None

    def state_dict(self) -> Optional[dict[str, Any]]:
        if self.curriculum_scheduler is None and self.progressive_layer_drop is None:
            return None
        return {"curriculum_scheduler": (self.curriculum_scheduler.state_dict()
                                         if self.curriculum_scheduler is not None else None),
                "progressive_layer_drop": (self.progressive_layer_drop.state_dict()
                                           if self.progressive_layer_drop is not None else None)}

    def load_state_dict(self, state: Optional[Mapping[str, Any]],
                        random_ltd: Optional[Mapping[str, Any]] = None) -> None:
        """Restores what the checkpoint has for the schedules this run has (a missing part keeps its start)."""
        if self.random_ltd_scheduler is not None and random_ltd:
            self.random_ltd_scheduler.load_state_dict(random_ltd)
        if not state:
            return
        if self.curriculum_scheduler is not None and state.get("curriculum_scheduler"):
            self.curriculum_scheduler.load_state_dict(state["curriculum_scheduler"])
        if self.progressive_layer_drop is not None and state.get("progressive_layer_drop"):
            self.progressive_layer_drop.load_state_dict(state["progressive_layer_drop"])
