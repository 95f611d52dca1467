"""The end-to-end demo: a real elastic JAX job on this machine, failures injected, recovery reported.

``runner`` runs the job (``remesh demo``), ``report`` turns the event log and the trainers' step
records into report.json (pure), ``timeline`` draws timeline.png, ``display`` shows the run live.
"""
