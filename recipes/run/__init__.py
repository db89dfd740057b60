"""Running a recipe: the stage loop, its step, LR schedule, fault policy, metrics and the run lock."""
