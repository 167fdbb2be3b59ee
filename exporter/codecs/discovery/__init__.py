"""Service discovery, pure: discovery documents → target label sets → relabelling → workers.

:mod:`.groups` reads each format (file_sd / http_sd target groups, a Prometheus server's targets,
a router's worker list, Dynamo's etcd registry), :mod:`.relabel` applies Prometheus-style
``relabel_configs``, :mod:`.workers` turns a relabelled target into the worker it names. The I/O
(files watched, URLs polled, etcd read) is ``exporter.sources.discovery``.
"""
