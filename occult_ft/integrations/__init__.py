"""Optional integrations with other libraries (PEFT, DeepSpeed); each module imports its library lazily."""

__all__: list[str] = []
