"""Live view of a unicron job: status rendering and client, event log reader, metrics, status line.

Entry points for other subsystems:

- ``render_status(snapshot, now)``: the rich view of a coordinator status snapshot.
- ``StatusLine(console, mode)`` / ``format_status_line(snapshot, now)``: `unicron run`'s status line.
- ``start_metrics_server(port, collect)`` / ``MetricsRecorder``: the Prometheus endpoint.
- ``commands.register(app)``: the `status` and `events` commands.
"""

from unicron.status.metrics import MetricsRecorder, format_metrics, start_metrics_server, stop_metrics_server
from unicron.status.render import render_status
from unicron.status.statusline import StatusLine, format_status_line

__all__ = ["MetricsRecorder", "StatusLine", "format_metrics", "format_status_line", "render_status",
           "start_metrics_server", "stop_metrics_server"]
