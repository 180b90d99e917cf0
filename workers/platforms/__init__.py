"""The platforms trials run on, one folder each (adapter, config model, settings, what it ships), and the
table that names them: adding a platform is its folder and one line here.

core.registry reads this table by module name, and imports an adapter only when its platform is asked for,
so the manager and core never import a platform's code (and a process loads only the platforms it uses).
"""

PLATFORMS = {
    "local": "workers.platforms.local.adapter:LocalPlatform",
    "remote": "workers.platforms.remote.adapter:RemotePlatform",
    "kubeflow": "workers.platforms.kubernetes.kubeflow.adapter:KubeflowPlatform",
    "frameworkcontroller": "workers.platforms.kubernetes.frameworkcontroller.adapter:FrameworkControllerPlatform",
    "openpai": "workers.platforms.openpai.adapter:OpenpaiPlatform",
    "dlts": "workers.platforms.dlts.adapter:DltsPlatform",
    "aml": "workers.platforms.aml.adapter:AmlPlatform",
}
