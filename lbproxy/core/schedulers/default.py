"""The default scheduler: the one of a virtual server without a `scheduler:` key.

A module of its own that imports nothing: the configuration model (config/model.py)
gives it as `VirtualServerConfig.scheduler`'s default, and only the schedulers' package
names a scheduler (tests/unit/core/schedulers/test_registry.py), so the model reads it
here without importing the registry, whose schedulers read the model.
"""

DEFAULT = "wlc"
