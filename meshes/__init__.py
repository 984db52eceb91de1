"""Monarch actor meshes of composer-replication (the only package besides ``recipes`` that imports Monarch).

- :mod:`.hosts`: ``local_meshes`` (one proc mesh per role on ``this_host()``), ``RoleMeshes.stop``,
  ``attach_meshes`` (Monarch workers on several hosts), ``ReplicaHosts`` (one proc mesh per DiLoCo replica).
- :mod:`.replicas`: ``ReplicaSet`` (DiLoCo replicas: step, restart on a fresh proc mesh, move to a spare worker).
- :mod:`.trainer`: ``StudentTrainer`` (a ``StudentTrainerCore`` per replica).
- :mod:`.teacher`: ``TeacherReplay`` (teacher backends; streams DPO pairs on a Port).
- :mod:`.reducer`: ``Reducer`` (averages tensors and metrics across replicas).
- :mod:`.supervision`: ``ActorFailure``, ``wait`` (timeouts), ``names_rank``, ``install_fault_hook``.
"""

from meshes.hosts import ReplicaHosts, RoleMeshes, attach_meshes, child_pids, local_meshes
from meshes.reducer import Reducer, mean_metrics, mean_tensors
from meshes.replicas import ReplicaSet
from meshes.supervision import ActorFailure, FaultLog, FaultSpec, install_fault_hook, names_rank, stream, wait
from meshes.teacher import TeacherReplay
from meshes.trainer import StudentTrainer, replica_dir

__all__ = ["RoleMeshes", "ReplicaHosts", "ReplicaSet", "local_meshes", "attach_meshes", "child_pids", "StudentTrainer",
           "TeacherReplay", "Reducer", "mean_tensors", "mean_metrics", "ActorFailure", "FaultLog", "install_fault_hook",
           "names_rank", "wait", "stream", "FaultSpec", "replica_dir"]
