"""Running a plan: the run directory's layout (rundir), the launcher around verl's main_ppo, the Ray
cluster bring-up, credential scrubbing, the learning gates and the smoke report. Imports no torch."""
