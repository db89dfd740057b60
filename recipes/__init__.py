"""Entry points: run a recipe's stages in order (`recipes.train`), one stage's loop (`recipes.run.stage`)."""
