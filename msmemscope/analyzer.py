"""The original's analyzer classes (``from msmemscope.analyzer import LeaksAnalyzer, LeaksConfig``).

A config holds an analysis' parameters (those of ``msmemscope.get_analyzer_config(name)``);
``Analyzer().analyze(config)`` runs it through ``msmemscope.analyze`` and returns its result::

    from msmemscope.analyzer import LeaksAnalyzer, LeaksConfig
    LeaksAnalyzer().analyze(LeaksConfig(input_path="dump.csv", mstx_info="test", start_index=0))
"""
from __future__ import annotations

from .analysis.registry import analyze, get_analyzer_config

__all__ = ["LeaksAnalyzer", "LeaksConfig", "InefficientAnalyzer", "InefficientConfig"]


class _Config:
    analyzer = ""

    def __init__(self, **kw):
        params = get_analyzer_config(self.analyzer)["parameters"]
        unknown = sorted(set(kw) - set(params))
        if unknown:
            raise TypeError(f"{type(self).__name__}: unknown parameter {unknown[0]!r} "
                            f"(parameters: {', '.join(params)})")
        self.params = {**params, **kw}

    def __getattr__(self, name):
        try:
            return self.__dict__["params"][name]
        except KeyError:
            raise AttributeError(name) from None

    def __repr__(self):
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.params.items())})"


class LeaksConfig(_Config):
    """``input_path``, ``mstx_info``, ``start_index`` (see ``msmemscope.check_leaks``)."""
    analyzer = "leaks"


class InefficientConfig(_Config):
    """``input_path``, ``mem_size``, ``inefficient_type``, ``idle_threshold`` (see ``msmemscope.check_inefficient``)."""
    analyzer = "inefficient"


class _Analyzer:
    config_type = _Config

    def analyze(self, config):
        if not isinstance(config, self.config_type):
            raise TypeError(f"{type(self).__name__}.analyze() takes a {self.config_type.__name__}, "
                            f"not {type(config).__name__}")
        return analyze(config.analyzer, **config.params)


class LeaksAnalyzer(_Analyzer):
    config_type = LeaksConfig


class InefficientAnalyzer(_Analyzer):
    config_type = InefficientConfig
