"""`sinkflow presets`: list the shipped presets with their method and data."""

from sinkflow import config


def add_parser(sub):
    p = sub.add_parser("presets", help="list the presets", description="List the shipped presets.",
                       epilog="example: sinkflow presets")
    p.set_defaults(func=run)


def run(args):
    for name in config.preset_names():
        tree = config.load_preset(name)
        d = tree["data"]
        print(f"{name:<20} {tree['experiment']['method']:<7} {d['source']} -> {d['target']}")
