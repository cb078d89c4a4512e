# NixOS module for berth (sketch; the NixOS deployer and the audit units
# come with later issues). Usage:
#   imports = [ ./nix/module.nix ];
#   services.berth.enable = true;
{ config, lib, pkgs, ... }:
let cfg = config.services.berth;
in {
  options.services.berth = {
    enable = lib.mkEnableOption "berth deployment control plane";
    package = lib.mkOption { type = lib.types.package; description = "The berth package."; };
    listen = lib.mkOption { type = lib.types.str; default = "127.0.0.1:8080"; };
    dataDir = lib.mkOption { type = lib.types.path; default = "/var/lib/berth"; };
    extraArgs = lib.mkOption { type = lib.types.listOf lib.types.str; default = [ ]; };
  };
  config = lib.mkIf cfg.enable {
    users.users.berth = { isSystemUser = true; group = "berth"; home = cfg.dataDir; };
    users.groups.berth = { };
    systemd.services.berth = {
      wantedBy = [ "multi-user.target" ];
      after = [ "network.target" ];
      serviceConfig = {
        User = "berth";
        Group = "berth";
        StateDirectory = "berth";
        StateDirectoryMode = "0700";
        ExecStart = lib.escapeShellArgs ([ "${cfg.package}/bin/berth" "serve" "--listen" cfg.listen "--data-dir" cfg.dataDir ] ++ cfg.extraArgs);
        # berth waits up to --shutdown-grace for running builds on SIGTERM.
        TimeoutStopSec = "60s";
        # Deployers run in their own process groups and may outlive berth;
        # the next start recovers (and stops) them.
        KillMode = "process";
        Restart = "on-failure";
      };
    };
  };
}
