"""Service discovery's I/O: :mod:`.providers` reads files, polls URLs and asks etcd; :mod:`.manager`
follows them and hands the worker set on (parsing and relabelling: ``exporter.codecs.discovery``)."""
