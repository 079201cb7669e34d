"""The process: the server and its reloads, workers, systemd notify, logs."""
