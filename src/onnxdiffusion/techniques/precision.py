"""The precision schedule: the steps it names run the high-precision backbone. The schedule itself is
runtime/hooks/schedule.py's ``PrecisionSchedule``; its Loop twin samplers/graph_schedule.py."""

from __future__ import annotations

from .host_base import HostTechnique

NAME = "precision_schedule"


class ScheduleHost(HostTechnique):
    name = NAME

    def __init__(self, schedule, high_session):
        self.schedule, self.high_session = schedule, high_session

    def wrap(self, model_fn, ctx):
        high_fn = ctx.guided(self.high_session)
        ctx.backbones.append(high_fn)
        return self.schedule.wrap(model_fn, high_fn)
