"""The pure core: pool, real servers, health, throttle, persistence, schedulers. No trio."""
