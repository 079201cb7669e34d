"""The control plane beside the proxy: health checks, SNMP, throttle, conditioning, discovery."""
