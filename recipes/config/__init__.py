"""A recipe's configuration: the dataclass schema and its validation into each stage's plan."""
