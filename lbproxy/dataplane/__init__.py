"""The data plane: listeners, the connection handler, the queue, the virtual server."""
