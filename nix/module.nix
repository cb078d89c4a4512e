# NixOS module for berth: a hardened service, the daily audit verify and the
# periodic audit head push; and, on any machine, a build worker
# (`services.berth.worker`, workers.md); and, on a node, its pull agent
# (`services.berth.agent`, agents.md).
#
#   imports = [ berth.nixosModules.default ];   # or ./nix/module.nix
#   services.berth.enable = true;
#   services.berth.defaultSource = "url=/etc/berth/source,rev=v1,digest=sha256:...";
#
# Every option maps to a `berth serve` flag (`berth serve --help` has the
# details); `extraArgs` takes any other.
{ config, lib, pkgs, ... }:
let
  cfg = config.services.berth;
  inherit (lib) mkOption mkEnableOption mkIf types optional optionals optionalAttrs;
  dataDir = "/var/lib/berth";
  # Deployers run as `deployerUser` work here, outside the data dir
  # (which stays 0700): berth's own default for --deployer-dir.
  deployersDir = "/var/lib/berth-deployers";
  # Who owns the store: the audit units read it as that user.
  serviceUser = if cfg.deployerUser == null then "berth" else "root";
  flag = name: value: optionals (value != null) [ "--${name}" (toString value) ];
  # A password in the store URL would show in the unit and the process
  # list: refused at evaluation, as berth refuses it at start.
  checkedStore = url:
    if builtins.match "postgres(ql)?://[^/@]*:[^/@]*@.*" url != null
    then throw "services.berth.store holds a password: put the URL in services.berth.storeFile (store_url_has_password)"
    else url;
  list = name: values: optionals (values != [ ]) [ "--${name}" (lib.concatStringsSep "," values) ];
  args =
    [ "${cfg.package}/bin/berth" "serve" "--listen" cfg.listen "--data-dir" dataDir ]
    ++ flag "deployer" cfg.deployer
    ++ flag "deployer-user" cfg.deployerUser
    ++ optionals (cfg.deployerUser != null) [ "--deployer-dir" deployersDir ]
    ++ flag "default-source" cfg.defaultSource
    ++ list "source-origin" cfg.sourceOrigins
    ++ list "callback-origin" cfg.callbackOrigins
    ++ list "cors-origin" cfg.corsOrigins
    ++ flag "build-slots" cfg.buildSlots
    ++ flag "eval-slots" cfg.evalSlots
    ++ flag "build-timeout" cfg.buildTimeout
    ++ flag "eval-timeout" cfg.evalTimeout
    ++ flag "shutdown-grace" cfg.shutdownGrace
    ++ flag "authz-url" cfg.authzUrl
    ++ flag "audit-retention-days" cfg.audit.retentionDays
    ++ flag "audit-denial-interval" cfg.audit.denialInterval
    ++ flag "audit-origin" cfg.audit.origin
    ++ optional cfg.metricsPublic "--metrics-public"
    ++ optionals (!cfg.localWorker) [ "--local-worker" "off" ]
    ++ list "local-labels" cfg.localLabels
    ++ list "build-labels" cfg.buildLabels
    ++ flag "lease-ttl" cfg.leaseTtl
    ++ flag "max-work-state" cfg.maxWorkState
    # The store in PostgreSQL (docs/cluster.md); a password only in storeFile.
    ++ storeArgs
    ++ flag "replica-url" cfg.replicaUrl
    ++ flag "replica-name" cfg.replicaName
    # Secrets come as systemd credentials, readable by this unit only.
    ++ optionals (cfg.serviceTokenFile != null) [ "--service-token-file" "%d/service-token" ]
    ++ optionals (cfg.callbackSecretFile != null) [ "--callback-secret-file" "%d/callback-secret" ]
    ++ cfg.extraArgs;
  wcfg = cfg.worker;
  required = name: value: if value == null then throw "services.berth.worker.${name} is required" else value;
  workerArgs =
    [ "${wcfg.package}/bin/berth" "worker" "--url" (required "url" wcfg.url) "--token-file" "%d/worker-token"
      "--work-dir" wcfg.workDir "--slots" (toString wcfg.slots) "--deployer" wcfg.deployer ]
    ++ list "labels" wcfg.labels
    ++ flag "deployer-user" wcfg.deployerUser
    ++ optional wcfg.allowHttp "--allow-http"
    ++ flag "ca-file" (if wcfg.caFile == null then null else "${wcfg.caFile}")
    ++ wcfg.extraArgs;
  acfg = cfg.agent;
  requiredAgent = name: value: if value == null then throw "services.berth.agent.${name} is required" else value;
  agentArgs =
    [ "${acfg.package}/bin/berth" "agent" "--url" (requiredAgent "url" acfg.url) "--token-file" "%d/agent-token"
      "--node" (requiredAgent "node" acfg.node) "--state-dir" "/var/lib/berth-agent"
      "--report-interval" acfg.reportInterval "--keep" (toString acfg.keep)
      # After a confirm that changed this unit, the agent exits and
      # systemd starts the new one (restartIfChanged is off below).
      "--unit" "berth-agent.service" ]
    ++ flag "check-command" acfg.checkCommand
    ++ flag "ca-file" (if acfg.caFile == null then null else "${acfg.caFile}")
    ++ list "substituter" acfg.substituters
    ++ optional acfg.allowHttp "--allow-http"
    ++ acfg.extraArgs;
  # The audit units read the store and nothing secret.
  secrets = [
    "-/run/credentials/berth.service"
    "-${dataDir}/service-token"
    "-${dataDir}/cursor-key"
    "-${dataDir}/callback-secret"
  ];
  # Where the store is, for the server and the audit units alike.
  storeArgs =
    optionals (cfg.store != "redb") [ "--store" (checkedStore cfg.store) ]
    ++ optionals (cfg.storeFile != null) [ "--store-file" "%d/store-url" ];

  auditUnit = { description, command, readWrite, hidden }: {
    inherit description;
    after = [ "berth.service" ];
    serviceConfig = {
      Type = "oneshot";
      User = serviceUser;
      Group = serviceUser;
      ExecStart = lib.escapeShellArgs command;
      # A problem in the chain fails the unit (exit 1): it shows in
      # `systemctl --failed` and in monitoring of failed units.
      # With the store in PostgreSQL the chain is the database's.
      LoadCredential = optional (cfg.storeFile != null) "store-url:${cfg.storeFile}";
      SyslogIdentifier = "berth-audit";
      LogExtraFields = "BERTH_AUDIT=1";
      ProtectSystem = "strict";
      ReadOnlyPaths = [ "${dataDir}/berth.redb" ];
      # A berth holding the store alone (the default) answers with a
      # snapshot in snapshots/, which the reader deletes when done.
      ReadWritePaths = [ "-${dataDir}/snapshots" ] ++ optionals readWrite [ dataDir ];
      InaccessiblePaths = secrets ++ hidden;
      ProtectHome = true;
      PrivateTmp = true;
      NoNewPrivileges = true;
      PrivateDevices = true;
      CapabilityBoundingSet = [ "" ];
      RestrictAddressFamilies = [ "AF_UNIX" "AF_INET" "AF_INET6" ];
      SystemCallFilter = [ "@system-service" ];
    };
  };
in
{
  options.services.berth = {
    enable = mkEnableOption "berth, the deployment control plane";
    package = mkOption {
      type = types.package;
      description = "The berth package (the flake sets its own).";
    };
    listen = mkOption { type = types.str; default = "127.0.0.1:8080"; description = "Address to listen on."; };
    deployer = mkOption {
      type = types.str;
      default = "builtin:nix";
      description = "builtin:nix (Nix code of the source), builtin:local, or an executable.";
    };
    deployerUser = mkOption {
      type = types.nullOr types.str;
      default = null;
      description = ''
        Run deployers as this user. berth then runs as root with exactly the
        capabilities it needs for that (see CapabilityBoundingSet below);
        without it berth runs as the `berth` user with none.
      '';
    };
    defaultSource = mkOption {
      type = types.nullOr types.str;
      default = null;
      example = "url=/etc/berth/source,rev=v1,digest=sha256:<nix-hash --type sha256 of the directory>";
      description = "The source new deployments use, and automatic updates move to.";
    };
    sourceOrigins = mkOption { type = types.listOf types.str; default = [ ]; description = "Origins a submitted source may come from."; };
    callbackOrigins = mkOption { type = types.listOf types.str; default = [ ]; description = "Origins destroy callbacks may go to."; };
    corsOrigins = mkOption { type = types.listOf types.str; default = [ ]; description = "Browser front-ends on other origins allowed to call berth (exact origins)."; };
    buildSlots = mkOption { type = types.nullOr types.int; default = null; description = "Builds running at once (berth's default: 4)."; };
    evalSlots = mkOption { type = types.nullOr types.int; default = null; description = "Evaluations at once (default 2)."; };
    buildTimeout = mkOption { type = types.nullOr types.str; default = null; example = "6h"; description = "Per build (default 24h; 0 turns it off)."; };
    evalTimeout = mkOption { type = types.nullOr types.str; default = null; example = "2m"; description = "Per evaluation (default 60s)."; };
    shutdownGrace = mkOption { type = types.str; default = "30s"; description = "How long a stop waits for running builds before ending them."; };
    authzUrl = mkOption { type = types.nullOr types.str; default = null; description = "The authorization callback for tokens other than the service token."; };
    metricsPublic = mkOption { type = types.bool; default = false; description = "Serve /metrics without the token."; };
    store = mkOption {
      type = types.str;
      default = "redb";
      example = "postgres://berth@db.internal/berth";
      description = "Where the store lives: redb (the state directory) or a postgres:// URL without a password (docs/cluster.md).";
    };
    storeFile = mkOption {
      type = types.nullOr types.path;
      default = null;
      description = "A file whose first line is the store URL, with its password, passed as a credential (--store-file).";
    };
    replicaUrl = mkOption { type = types.nullOr types.str; default = null; example = "http://10.0.0.1:8080"; description = "With PostgreSQL: where the other replicas forward requests while this one leads."; };
    replicaName = mkOption { type = types.nullOr types.str; default = null; description = "With PostgreSQL: this replica's name in GET /v1/cluster."; };
    serviceTokenFile = mkOption {
      type = types.nullOr types.path;
      default = null;
      description = "The service token, passed as a systemd credential (else berth makes one in its state directory).";
    };
    callbackSecretFile = mkOption { type = types.nullOr types.path; default = null; description = "The callback signing secret, as a credential."; };
    nix = {
      builders = mkOption {
        type = types.nullOr types.str;
        default = null;
        example = "ssh://builder x86_64-linux";
        description = "Nix remote builders for the Nix deployer (Nix's own `builders` option).";
      };
      activateCommand = mkOption {
        type = types.nullOr types.str;
        default = null;
        description = "Replaces nix-copy-closure + switch-to-configuration over SSH (and its armed revert); sees NODE, TOPLEVEL, TARGET.";
      };
      confirmTimeout = mkOption {
        type = types.nullOr types.int;
        default = null;
        description = "Seconds after an activation before a target goes back to its previous system unless berth confirmed it (default 300; keep it above berth's --health-timeout).";
      };
      keep = mkOption {
        type = types.nullOr types.int;
        default = null;
        description = "Confirmed systems per node kept with a GC root, so a rollback to one builds nothing (default 5).";
      };
      sshOptions = mkOption {
        type = types.nullOr types.str;
        default = null;
        example = "-i /run/keys/berth-deploy -o StrictHostKeyChecking=yes";
        description = "Options for ssh and nix-copy-closure (Nix's NIX_SSHOPTS).";
      };
    };
    audit = {
      sink = mkOption { type = types.nullOr types.str; default = null; description = "Witness sink URL: when set, signed heads are pushed there."; };
      verifyInterval = mkOption { type = types.str; default = "daily"; description = "OnCalendar of berth-audit-verify.timer."; };
      pushInterval = mkOption { type = types.str; default = "hourly"; description = "OnCalendar of berth-audit-push-head.timer."; };
      retentionDays = mkOption { type = types.nullOr types.int; default = null; description = "Audit events older than this are removed (default 365; 0 keeps all)."; };
      denialInterval = mkOption { type = types.nullOr types.str; default = null; description = "Anonymous denials are recorded once per interval (default 60s)."; };
      origin = mkOption { type = types.nullOr types.str; default = null; description = "Checkpoint origin line (default berth/<hostname>/audit)."; };
    };
    extraArgs = mkOption { type = types.listOf types.str; default = [ ]; description = "More `berth serve` flags (--shared-store too: the audit timers then read the live store file itself)."; };
    localWorker = mkOption { type = types.bool; default = true; description = "Whether berth runs builds itself (false: only `berth worker` processes do)."; };
    localLabels = mkOption { type = types.listOf types.str; default = [ ]; description = "Labels the embedded worker offers."; };
    buildLabels = mkOption { type = types.listOf types.str; default = [ ]; description = "Labels every build requires of its worker."; };
    maxWorkState = mkOption { type = types.nullOr types.int; default = null; example = 268435456; description = "The largest work state (bytes) a deployment keeps between builds on workers (default 64 MiB; 1 MiB to 4 GiB)."; };
    leaseTtl = mkOption { type = types.nullOr types.str; default = null; example = "1m"; description = "How long a worker's claim or renew holds its build (default 30s; 5s to 10m)."; };
    worker = {
      enable = mkEnableOption "a berth build worker on this machine";
      package = mkOption { type = types.package; default = cfg.package; defaultText = "config.services.berth.package"; description = "The berth package (by default services.berth.package, which the flake sets)."; };
      url = mkOption { type = types.nullOr types.str; default = null; example = "https://berth.example.org"; description = "berth's address (https unless on loopback or allowHttp); required."; };
      tokenFile = mkOption { type = types.nullOr types.path; default = null; description = "The worker token (`berth tokens create NAME --kind worker`), passed as a systemd credential; required."; };
      labels = mkOption { type = types.listOf types.str; default = [ ]; description = "Labels this worker offers."; };
      slots = mkOption { type = types.int; default = 1; description = "Builds at once (1-64)."; };
      workDir = mkOption { type = types.str; default = "/var/lib/berth-worker"; description = "Its directory (0700, locked)."; };
      deployer = mkOption { type = types.str; default = "builtin:nix"; description = "The deployer it runs (as services.berth.deployer)."; };
      deployerUser = mkOption { type = types.nullOr types.str; default = null; description = "Run deployers as this user (the worker then runs as root)."; };
      allowHttp = mkOption { type = types.bool; default = false; description = "Allow http:// to a berth that is not on loopback."; };
      caFile = mkOption { type = types.nullOr types.path; default = null; description = "PEM certificates trusted besides the system's roots for berth's https (a private CA; public, so the store may hold it)."; };
      extraArgs = mkOption { type = types.listOf types.str; default = [ ]; description = "More `berth worker` flags."; };
    };
    agent = {
      enable = mkEnableOption "the berth pull agent of this node (agents.md)";
      package = mkOption { type = types.package; default = cfg.package; defaultText = "config.services.berth.package"; description = "The berth package (by default services.berth.package, which the flake sets)."; };
      url = mkOption { type = types.nullOr types.str; default = null; example = "https://berth.example.org"; description = "berth's address (https unless on loopback or allowHttp); required."; };
      tokenFile = mkOption { type = types.nullOr types.path; default = null; description = "The agent token (`berth tokens create NAME --kind agent --deployment D --node N`), passed as a systemd credential, never in the store; required."; };
      node = mkOption { type = types.nullOr types.str; default = null; example = "alice/web"; description = "`DEPLOYMENT/NODE`, the token's binding; required."; };
      reportInterval = mkOption { type = types.str; default = "60s"; description = "How often the agent reports what the node runs (1s to 1h)."; };
      substituters = mkOption { type = types.listOf types.str; default = [ ]; description = "Binary caches a toplevel is fetched from, tried in order; their keys go in nix.settings.trusted-public-keys."; };
      checkCommand = mkOption { type = types.nullOr types.str; default = null; description = "Health: a shell command, exit 0 healthy."; };
      allowHttp = mkOption { type = types.bool; default = false; description = "Allow http:// to a berth that is not on loopback."; };
      keep = mkOption { type = types.ints.between 0 100; default = 5; description = "Confirmed toplevels kept as GC roots besides the running and booted ones."; };
      caFile = mkOption { type = types.nullOr types.path; default = null; description = "PEM certificates trusted besides the system's roots for berth's https (a private CA; public, so the store may hold it)."; };
      extraArgs = mkOption { type = types.listOf types.str; default = [ ]; description = "More `berth agent` flags."; };
    };
  };

  # Each part by its own switch: a worker machine runs no berth.
  config = {
    users.users.berth = mkIf cfg.enable { isSystemUser = true; group = "berth"; home = dataDir; };
    users.groups.berth = mkIf cfg.enable { };

    systemd.services.berth = mkIf cfg.enable {
      description = "berth deployment control plane";
      wantedBy = [ "multi-user.target" ];
      after = [ "network-online.target" ];
      wants = [ "network-online.target" ];
      path = [ config.nix.package pkgs.openssh ];
      environment = {
        NIX_REMOTE = "daemon";
      } // optionalAttrs (cfg.nix.builders != null) { BERTH_NIX_BUILDERS = cfg.nix.builders; }
        // optionalAttrs (cfg.nix.activateCommand != null) { BERTH_NIX_ACTIVATE = cfg.nix.activateCommand; }
        // optionalAttrs (cfg.nix.confirmTimeout != null) { BERTH_NIX_CONFIRM_TIMEOUT = toString cfg.nix.confirmTimeout; }
        // optionalAttrs (cfg.nix.keep != null) { BERTH_NIX_KEEP = toString cfg.nix.keep; }
        // optionalAttrs (cfg.nix.sshOptions != null) { NIX_SSHOPTS = cfg.nix.sshOptions; };
      serviceConfig = {
        ExecStart = lib.escapeShellArgs args;
        LoadCredential =
          optional (cfg.storeFile != null) "store-url:${cfg.storeFile}"
          ++ optional (cfg.serviceTokenFile != null) "service-token:${cfg.serviceTokenFile}"
          ++ optional (cfg.callbackSecretFile != null) "callback-secret:${cfg.callbackSecretFile}";
        # berth makes the deployers' dir 0711 itself; systemd makes both
        # writable under ProtectSystem.
        StateDirectory = [ "berth" ] ++ optional (cfg.deployerUser != null) "berth-deployers";
        StateDirectoryMode = "0700";
        # berth ends its own deployers on SIGTERM (storage.md: it waits
        # --shutdown-grace for running builds, then stops them and records
        # them failed), so systemd signals berth only and kills what is
        # left only after the timeout.
        KillMode = "mixed";
        TimeoutStopSec = "120s";
        Restart = "on-failure";
        ProtectSystem = "strict";
        ProtectHome = true;
        PrivateTmp = true;
        PrivateDevices = true;
        NoNewPrivileges = true;
        ProtectKernelTunables = true;
        ProtectKernelModules = true;
        ProtectControlGroups = true;
        RestrictSUIDSGID = true;
        LockPersonality = true;
        RestrictAddressFamilies = [ "AF_UNIX" "AF_INET" "AF_INET6" ];
        SystemCallFilter = [ "@system-service" ];
      } // (if cfg.deployerUser == null then {
        User = "berth";
        Group = "berth";
        CapabilityBoundingSet = [ "" ];
      } else {
        # Root, with exactly what running deployers as another user takes:
        # SETUID/SETGID to become it, CHOWN to hand it its work and scratch
        # dirs, KILL to signal its process group on cancel and timeout,
        # DAC_OVERRIDE to read its results and remove its dirs after destroy.
        CapabilityBoundingSet = [ "CAP_SETUID" "CAP_SETGID" "CAP_CHOWN" "CAP_KILL" "CAP_DAC_OVERRIDE" ];
      });
    };

    systemd.services.berth-audit-verify = mkIf cfg.enable (auditUnit {
      description = "Verify berth's audit chain";
      command = [ "${cfg.package}/bin/berth" "audit" "verify" "--data-dir" dataDir ] ++ storeArgs;
      readWrite = false;
      # Verifying signs nothing.
      hidden = [ "-${dataDir}/audit-signing.key" ];
    });
    systemd.timers.berth-audit-verify = mkIf cfg.enable {
      wantedBy = [ "timers.target" ];
      timerConfig = { OnCalendar = cfg.audit.verifyInterval; Persistent = true; };
    };

    systemd.services.berth-audit-push-head = mkIf (cfg.enable && cfg.audit.sink != null) (auditUnit {
      description = "Push berth's signed audit head to the witness sink";
      command = [ "${cfg.package}/bin/berth" "audit" "push-head" "--data-dir" dataDir "--sink" cfg.audit.sink ]
        ++ optionals (cfg.audit.origin != null) [ "--audit-origin" cfg.audit.origin ]
        ++ storeArgs;
      # It records the accepted head (audit-pushed-head.json) beside the store.
      readWrite = true;
      hidden = [ ];
    });
    systemd.timers.berth-audit-push-head = mkIf (cfg.enable && cfg.audit.sink != null) {
      wantedBy = [ "timers.target" ];
      timerConfig = { OnCalendar = cfg.audit.pushInterval; Persistent = true; };
    };

    systemd.services.berth-agent = mkIf acfg.enable {
      description = "berth pull agent";
      wantedBy = [ "multi-user.target" ];
      after = [ "network-online.target" ];
      wants = [ "network-online.target" ];
      # An activation never stops the agent that runs it.
      restartIfChanged = false;
      path = [ config.nix.package ];
      serviceConfig = {
        ExecStart = lib.escapeShellArgs agentArgs;
        # The token is a credential, readable by this unit only.
        LoadCredential = [ "agent-token:${toString (requiredAgent "tokenFile" acfg.tokenFile)}" ];
        StateDirectory = "berth-agent";
        StateDirectoryMode = "0700";
        # On SIGTERM it reverts an unconfirmed activation before it exits.
        TimeoutStopSec = "120s";
        Restart = "always";
        # Exit 3: berth refused the token (revoked); restarting cannot help.
        RestartPreventExitStatus = 3;
      };
    };

    systemd.services.berth-worker = mkIf wcfg.enable {
      description = "berth build worker";
      wantedBy = [ "multi-user.target" ];
      after = [ "network-online.target" ];
      wants = [ "network-online.target" ];
      path = [ config.nix.package pkgs.openssh ];
      environment.NIX_REMOTE = "daemon";
      serviceConfig = {
        ExecStart = lib.escapeShellArgs workerArgs;
        # The token is a credential, readable by this unit only.
        LoadCredential = [ "worker-token:${toString (required "tokenFile" wcfg.tokenFile)}" ];
        StateDirectory = optional (wcfg.workDir == "/var/lib/berth-worker") "berth-worker";
        StateDirectoryMode = "0700";
        ReadWritePaths = optional (wcfg.workDir != "/var/lib/berth-worker") wcfg.workDir;
        # The worker stops its deployers itself on SIGTERM (after its
        # --shutdown-grace, then their --cancel-grace): systemd waits past
        # both before it kills what is left.
        KillMode = "mixed";
        TimeoutStopSec = "120s";
        Restart = "on-failure";
        # Exit 3: berth refused the token (revoked); restarting cannot help.
        RestartPreventExitStatus = 3;
        DynamicUser = wcfg.deployerUser == null;
        ProtectSystem = "strict";
        ProtectHome = true;
        PrivateTmp = true;
        NoNewPrivileges = wcfg.deployerUser == null;
        RestrictAddressFamilies = [ "AF_UNIX" "AF_INET" "AF_INET6" ];
      };
    };
  };
}
