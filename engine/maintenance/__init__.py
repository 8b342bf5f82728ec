"""Background upkeep of the base Lance table: indexes, compaction, old versions.

- `runner`: `Maintenance`, the tasks and the loops that run them (its docstring tells the
  tasks, their order and outcomes, standby, and the rule of version retention), with the
  sizing of the vector index.
- `process`: `MaintenanceProcess`, the same loops in a child process (the sink's default).
"""

from engine.maintenance.process import MaintenanceProcess
from engine.maintenance.runner import Maintenance, MaintenanceEvents, NoMaintenanceEvents

__all__ = ["Maintenance", "MaintenanceEvents", "MaintenanceProcess", "NoMaintenanceEvents"]
