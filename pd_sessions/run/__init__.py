"""Running configs: the options and plan of one config, the sweep loop, ``serve``, and the
user's own commands against a live cluster."""
