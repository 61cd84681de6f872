"""Environments of other frameworks served as `Environment`s: `gymnasium` (Gymnasium environments whose
observations are rendered as text; `pip install 'pipelinerl[gymnasium]'`) and `openenv` (OpenEnv
environments, in this process or behind an OpenEnv server; `pip install 'pipelinerl[openenv]'`)."""
