"""hpctrain's configs travel with the package: Hydra searches pkg://hpctrain.conf after the project's conf/
(the primary config's directory), so the project's own file of a group and name wins, and a command
line's hydra.searchpath=[...] still adds folders of its own."""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class HpctrainConfigs(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="hpctrain", path="pkg://hpctrain.conf")
