"""Bring your own cluster: `agent-rl launch` places a run's roles on a Ray cluster and keeps them
alive; the clusters come from `ray start` on each node (on-prem), a Slurm allocation
(`slurm.py` renders the sbatch) or KubeRay (docs/cluster.md)."""
