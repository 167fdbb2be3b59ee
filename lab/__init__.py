"""Where the simulated fleet and the exporter meet: what-if replay, the scenario harness, the
ground-truth recount and the demo. Nothing imports this package."""
