"""Multi-node runs: one agent per node, node 0 the primary.

Two ways a run becomes a node of a group, one notion of a node's role (role.NodeRole) for both:
- Slurm (`onbox sbatch --nodes N`): the node index comes from SLURM_NODEID (onbox/slurm/job.py);
- plain SSH boxes (`onboxctl run gpu1 gpu2 --nodes`): onboxctl hands every agent a node-group document (rank,
  peers, the rendezvous address, a shared key) over ssh's stdin (role.NodeGroup).
Node 0 alone commits checkpoints; the others restore what node 0 committed and never commit (hooks.py). On SSH
boxes the agents tell each other about a preemption, a stop or a hang restart over small authenticated UDP notices
(notices.py): the group stops, and restarts after a hang, together.

  role.py         a node's role, and the node-group document an SSH group's agents start with
  hooks.py        what a node's role changes in a run's hooks (who commits, where a node restores from)
  notices.py      authenticated UDP notices between the agents of an SSH group
  probe.py        `onbox node probe --json`: what onboxctl asks each box before it starts a group

Imports: the leaves and onbox.config only (onbox.slurm and onbox.subsystems build on this package).
"""
