"""Applications over the session API: batch jobs, the server, bench, tune, check, info, reports. `specrt.cli`
is their face."""
