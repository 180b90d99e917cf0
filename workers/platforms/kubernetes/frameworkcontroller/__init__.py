"""The `frameworkcontroller` platform: a Framework per trial (Microsoft's FrameworkController)."""
