"""The exporter's pure core: the cluster state and what it is made of (record and KV accounting,
metric store, worker pool, windows, sessions, hotspots, checks). No I/O; sources feed it model
values, the web floor and the loops read it."""
