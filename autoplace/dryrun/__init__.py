"""``autoplace dryrun``: what a bundle's launch builds before its first step, built by the framework's own code.

A bundle is checked the way it will run: its launch script is executed by bash with recording
stand-ins for the launchers (:mod:`autoplace.dryrun.launches`), the words the program receives are
handed to the framework, and the framework builds, on a fake process group at the planned world
size and on the meta device, what one rank builds before its first step (:mod:`autoplace.dryrun.run`,
one subprocess per rank: :mod:`autoplace.dryrun.worker`).  Each framework module says how
(:meth:`autoplace.frameworks.base.Framework.dry_run`), recording its steps and the bytes it allocated
per training state (:mod:`autoplace.dryrun.steps`); the run compares those with plan.json's prediction.

This package's ``__init__`` imports nothing: the framework modules import :mod:`autoplace.dryrun.steps`.
"""
