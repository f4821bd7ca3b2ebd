"""scripts/gpu_check's parts: the matrix and its time budget (plan.py, costs.py), the carried
wheels and the device check (wheels.py), one allocator setting's process (worker.py, which runs
the calibration harness's models and micro-batches), the budget's clock (budget.py) and the
outputs (report.py)."""
