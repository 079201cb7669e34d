"""`global.workers: N` (N > 1): a supervisor process and N proxy workers (SPEC §2, §9).

    supervisor (`run`, the process `lbproxy run` started)
      signals         SIGHUP: validate the files, then reload every worker; SIGTERM,
                      SIGINT, SIGUSR1, SIGQUIT: SIGTERM to every worker, exit 0 once
                      all have exited
      one task per worker slot
                      start `python -m lbproxy run --worker-fd FD -- CONFIG...`, send it
                      the configuration, wait for "ready", wait for its exit, restart it
                      (at once after a crash, with a growing delay when it keeps crashing)
      admin endpoint  on global.admin.listen and the admin socket (SupervisorApp, the
                      routes and the authorization of AdminApp):
                      /metrics adds up the workers' metrics, /api/v1 merges their
                      documents, a PATCH or a reload goes to every worker

    worker (`run_worker`)
      the ordinary Server on the supervisor's TCP listening sockets (below); UDP
      listeners and the DNS locator bound with SO_REUSEPORT (the kernel spreads
      datagrams across the workers' sockets by source, so a client's session stays in
      one worker); its admin endpoint on a private Unix socket in a folder only this
      user can enter (mode 0700)

The supervisor owns the TCP listening sockets (nginx's master and
HAProxy's master-worker do the same): it binds every TCP `listen` address of the
configuration once, before any worker starts, and every worker inherits the same
sockets (pass_fds) and accepts from them. So there is one accept queue per address,
which outlives any worker: a worker that dies, even by SIGKILL, takes only the
connections it had accepted (they are reset; docs/concepts/workers.md counts them); the
connections still queued are accepted by the other workers, and by its replacement.
With SO_REUSEPORT each worker had a queue of its own, and the kernel resets every
connection waiting in the queue of a socket that is closed (net.ipv4.tcp_migrate_req
would move them instead, but it is a host-wide sysctl that needs root, and off by
default). The cost: every worker waiting in epoll is woken by each new connection and
one wins the accept (the others see EAGAIN), so the spread across workers follows who
is idle rather than a hash. The supervisor closes its copy of a socket when a reload
drops its address, and all of them when it stops, so a stop refuses at once as before.
An address a reload adds is bound by the supervisor too, before any worker reloads,
and sent to every running worker over its channel ("listeners", with the descriptors,
answered "taken"); a worker started later inherits it as the others. So it has the
same single accept queue as the addresses present at start. After an upgrade, before
its SIGTERM, each old worker is told "upgraded" (answered "taken"): it closes its
UDP sockets at once (Server.close_udp_listeners), so they leave the SO_REUSEPORT group
and no datagram of a new client goes to a draining worker.

Supervisor and worker talk over a socketpair the worker inherits (protocol.py: every
message each way): the supervisor sends the running configuration, the worker answers
"ready" once every listener is bound, and reads on until end of file, which means the
supervisor is gone: it then stops accepting and drains, so no orphan keeps the ports.

Merging rules (docs/concepts/workers.md; each family's in admin/metric_families.py):
counters and histograms are added up, and so is `lbproxy_active_connections`; the
state-like gauges (MAX) take the highest value (a real server is up when any worker
sees it up; weights are the same in every worker); `lbproxy_config_reloads_total` counts
the supervisor's reloads (OWN). A worker that exits keeps its last scraped counters in
the sums, so they do not go backwards.
"""

from lbproxy.runtime.workers.merge import MetricSums, merge_documents, parse_metrics
from lbproxy.runtime.workers.supervisor import Supervisor, run
from lbproxy.runtime.workers.worker import run_worker

__all__ = ["MetricSums", "Supervisor", "merge_documents", "parse_metrics", "run", "run_worker"]
