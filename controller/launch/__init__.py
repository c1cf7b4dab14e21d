"""Putting work on boxes: the code pushed and verified, `onbox run` started detached (one box, many, or a multi-node
group), the record that lets the same line again find the run it continues, and the agent's own stop.

  plan.py         `onboxctl run` checked and resolved (RunPlan): every refusal before any box is asked
  runs.py         start(plan): which run each box continues, the launch, the keeper's enrolment, the launch log
  push.py         onbox.pyz and the code to a box, verified there; `secrets push`
  secretfiles.py  secret-looking files of a code dir that stay home (push, Kaggle)
  start.py        `onbox run` started on boxes over ssh, its answer read back
  launchlog.py    launches.json: the runs `onboxctl run` started
  relaunch.py     which run a launch continues (the same command again after a preemption)
  nodes.py        one multi-node group over several boxes
  stop.py         `onboxctl stop`: the agent's graceful stop and (--wait) how the run ended

May import controller.boxes, controller.userconfig (the tracker URL's rule) and onbox's library.
"""
