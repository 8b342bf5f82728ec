{{/*
Combinations of values that values.schema.json cannot express. Each fails the render with the
offending keys and what to do; included once from configmap.yaml (always rendered).
The sink validates the rendered config itself at start-up (`lance-sink check-config`); these
checks only cover what is about how Kubernetes runs it, or what would leak a secret.
*/}}
{{- define "lance-sink.validate" -}}
{{- $c := .Values.config -}}
{{- $mode := .Values.storage.mode -}}

{{/* required settings without a default */}}
{{- $_ := required "config.kafka.bootstrap_servers is required (host:port list of the brokers)" $c.kafka.bootstrap_servers -}}
{{- if not $c.kafka.topics -}}
{{- fail "config.kafka.topics is required: the topics to consume, e.g. [events]" -}}
{{- end -}}
{{- $_ := required "config.table.uri is required (s3://bucket/prefix, or a path under storage.localVolume.mountPath)" $c.table.uri -}}
{{- if and (not $c.table.columns) (not (has $c.source.format (list "avro" "protobuf" "json_schema"))) -}}
{{- fail "config.table.columns is required: at least one {name, type} column (only the registry formats avro, protobuf and json_schema derive them)" -}}
{{- end -}}

{{/* secrets never go into the ConfigMap */}}
{{- range $key, $where := dict "kafka.sasl_password" "secrets.kafkaSasl" "kafka.ssl_key_password" "secrets.kafkaTls.keyPasswordKey" "query.auth_token" "secrets.queryAuth" -}}
{{- $parts := splitList "." $key -}}
{{- if not (kindIs "invalid" (index $c (index $parts 0) (index $parts 1))) -}}
{{- fail (printf "config.%s must not be set in values (it would land in a ConfigMap): put it in a Secret and reference it with %s" $key $where) -}}
{{- end -}}
{{- end -}}
{{- range $opt, $_ := $c.table.storage_options -}}
{{- if regexMatch "(?i)(secret|password|token|access_key|credential)" $opt -}}
{{- fail (printf "config.table.storage_options.%s looks like a credential and would land in a ConfigMap: use secrets.objectStore (an existing Secret) or IRSA service-account annotations" $opt) -}}
{{- end -}}
{{- end -}}
{{- if and (hasPrefix "SASL" $c.kafka.security_protocol) (has $c.kafka.sasl_mechanism (list "PLAIN" "SCRAM-SHA-256" "SCRAM-SHA-512")) (not .Values.secrets.kafkaSasl.existingSecret) -}}
{{- fail (printf "config.kafka.security_protocol=%s with sasl_mechanism=%s needs the password: set secrets.kafkaSasl.existingSecret" $c.kafka.security_protocol $c.kafka.sasl_mechanism) -}}
{{- end -}}
{{- range .Values.extraEnv -}}
{{- if hasPrefix "LANCE_SINK__" .name -}}
{{- fail (printf "extraEnv %s: settings go under config and secrets under secrets, not into extraEnv" .name) -}}
{{- end -}}
{{- end -}}

{{/* storage modes */}}
{{- $uris := dict "config.table.uri" $c.table.uri -}}
{{- if $c.wal.uri -}}{{- $_ := set $uris "config.wal.uri" $c.wal.uri -}}{{- end -}}
{{- if $c.dlq.lance_table_uri -}}{{- $_ := set $uris "config.dlq.lance_table_uri" $c.dlq.lance_table_uri -}}{{- end -}}
{{- if eq $mode "objectStore" -}}
{{- range $key, $uri := $uris -}}
{{- if not (hasPrefix "s3://" $uri) -}}
{{- fail (printf "%s=%q: storage.mode objectStore keeps the table and the WAL in object storage (s3://bucket/prefix) so pods stay stateless; for a local directory use storage.mode localVolume" $key $uri) -}}
{{- end -}}
{{- end -}}
{{- else -}}
{{- $mount := trimSuffix "/" .Values.storage.localVolume.mountPath -}}
{{- range $key, $uri := $uris -}}
{{- if not (hasPrefix (printf "%s/" $mount) (trimPrefix "file://" $uri)) -}}
{{- fail (printf "%s=%q: with storage.mode localVolume it must be a path under storage.localVolume.mountPath (%s/...)" $key $uri $mount) -}}
{{- end -}}
{{- end -}}
{{- if ne (int .Values.replicaCount) 1 -}}
{{- fail (printf "replicaCount=%v: storage.mode localVolume runs exactly one pod (the table and WAL live on one ReadWriteOnce volume); set replicaCount: 1, or use storage.mode objectStore to scale out" .Values.replicaCount) -}}
{{- end -}}
{{- if .Values.keda.enabled -}}
{{- fail "keda.enabled: storage.mode localVolume runs exactly one pod and cannot scale; use storage.mode objectStore with KEDA" -}}
{{- end -}}
{{- if .Values.strategy -}}
{{- fail "strategy: storage.mode localVolume runs a StatefulSet, which replaces its one pod in place (the volume is ReadWriteOnce); strategy applies to the objectStore Deployment only, leave it {}" -}}
{{- end -}}
{{- end -}}

{{/* the query-only tier */}}
{{- if .Values.serve.enabled -}}
{{- if eq $mode "localVolume" -}}
{{- fail "serve.enabled: storage.mode localVolume keeps the table and the WAL on one ReadWriteOnce volume that only the writer pod mounts, so serve pods could not read them. Leave serve.enabled false (the writer pod answers queries), or use storage.mode objectStore for a query tier" -}}
{{- end -}}
{{- if not $c.query.enabled -}}
{{- fail "serve.enabled needs config.query.enabled: `lance-sink serve` only serves the query API, and it reads the writers' fresh rows through their query API (fan-out)" -}}
{{- end -}}
{{- if and .Values.networkPolicy.enabled (not .Values.networkPolicy.query.from) -}}
{{- fail "serve.enabled with networkPolicy.enabled needs networkPolicy.query.from: the clients allowed to query the serve Service (e.g. [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: search}}}]), or the policy lets no client reach the serve pods" -}}
{{- end -}}
{{- $serveRes := .Values.serve.resources -}}
{{- $serveNeedMiB := include "lance-sink.serve.memoryNeedMiB" . | int64 -}}
{{- with $serveRes.limits.memory -}}
{{- $limit := include "lance-sink.quantityBytes" (list "serve.resources.limits.memory" .) | float64 -}}
{{- if gt (mulf $serveNeedMiB 1048576) $limit -}}
{{- fail (printf "serve.resources.limits.memory (%v) cannot hold what a serve pod needs, %dMi = %dMi serve.resources.memory.overheadMiB + %dMi for the query API's caches (unindexed rows, Lance's index and metadata caches): raise it to at least %dMi, lower the caches in config.query (or serve.unindexedCacheBytes), or leave it null to derive it" . $serveNeedMiB (int64 $serveRes.memory.overheadMiB) (sub $serveNeedMiB (int64 $serveRes.memory.overheadMiB)) $serveNeedMiB) -}}
{{- end -}}
{{- end -}}
{{- with $serveRes.requests.memory -}}
{{- $request := include "lance-sink.quantityBytes" (list "serve.resources.requests.memory" .) | float64 -}}
{{- $limitMem := include "lance-sink.serve.memoryLimit" $ -}}
{{- if gt $request (include "lance-sink.quantityBytes" (list "serve.resources.limits.memory" $limitMem) | float64) -}}
{{- fail (printf "serve.resources.requests.memory (%v) is above the serve container's memory limit (%s): the API server refuses a pod whose request exceeds its limit. Lower it to at most %s, or leave it null (it defaults to the limit)" . $limitMem $limitMem) -}}
{{- end -}}
{{- end -}}
{{- if and $serveRes.requests.cpu $serveRes.limits.cpu -}}
{{- if gt (include "lance-sink.cpuMillis" (list "serve.resources.requests.cpu" $serveRes.requests.cpu) | float64) (include "lance-sink.cpuMillis" (list "serve.resources.limits.cpu" $serveRes.limits.cpu) | float64) -}}
{{- fail (printf "serve.resources.requests.cpu (%v) is above serve.resources.limits.cpu (%v): the API server refuses a pod whose request exceeds its limit" $serveRes.requests.cpu $serveRes.limits.cpu) -}}
{{- end -}}
{{- end -}}
{{- with .Values.serve.autoscaling -}}
{{- if .enabled -}}
{{- if gt (int64 .minReplicas) (int64 .maxReplicas) -}}
{{- fail (printf "serve.autoscaling.maxReplicas (%v) is below serve.autoscaling.minReplicas (%v): raise maxReplicas or lower minReplicas" .maxReplicas .minReplicas) -}}
{{- end -}}
{{- if and (kindIs "invalid" .targetCPUUtilizationPercentage) (kindIs "invalid" .targetMemoryUtilizationPercentage) -}}
{{- fail "serve.autoscaling.enabled needs a target to scale on: set serve.autoscaling.targetCPUUtilizationPercentage and/or serve.autoscaling.targetMemoryUtilizationPercentage" -}}
{{- end -}}
{{- if not (kindIs "invalid" .targetCPUUtilizationPercentage) -}}
{{- if or (not $serveRes.requests.cpu) (eq (include "lance-sink.cpuMillis" (list "serve.resources.requests.cpu" (default "0" $serveRes.requests.cpu)) | float64) 0.0) -}}
{{- fail (printf "serve.autoscaling.targetCPUUtilizationPercentage (%v) needs serve.resources.requests.cpu (above 0): the HorizontalPodAutoscaler measures CPU use as a share of the request, and without one it never scales. Set serve.resources.requests.cpu (e.g. 500m), or set targetCPUUtilizationPercentage to null and scale on targetMemoryUtilizationPercentage" .targetCPUUtilizationPercentage) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* KEDA */}}
{{- if .Values.keda.enabled -}}
{{- if kindIs "invalid" .Values.keda.partitions -}}
{{- fail "keda.enabled needs keda.partitions: the partition count of the largest topic (maxReplicaCount is capped at it; a pod beyond one per partition idles)" -}}
{{- end -}}
{{- if and (ne $c.kafka.security_protocol "PLAINTEXT") (not .Values.keda.authenticationRef) -}}
{{- fail (printf "keda.enabled with config.kafka.security_protocol=%s needs keda.authenticationRef: the name of an existing TriggerAuthentication holding what the scaler needs to reach the brokers (sasl, username, password for SASL; tls, ca, cert, key for TLS); without it KEDA connects unauthenticated and never reads the lag" $c.kafka.security_protocol) -}}
{{- end -}}
{{- if gt (int64 .Values.keda.minReplicaCount) (int64 (include "lance-sink.kedaMaxReplicas" .)) -}}
{{- fail (printf "keda.minReplicaCount (%v) is above the replica cap min(keda.maxReplicaCount, keda.partitions) = %s" .Values.keda.minReplicaCount (include "lance-sink.kedaMaxReplicas" .)) -}}
{{- end -}}
{{- end -}}

{{/* static membership needs one id per pod */}}
{{- if and $c.kafka.group_instance_id (or .Values.keda.enabled (gt (int .Values.replicaCount) 1)) -}}
{{- fail "config.kafka.group_instance_id must be unique per pod: use it only with replicaCount 1 and without KEDA" -}}
{{- end -}}

{{/* the kubelet probes the pod IP; the Service needs two distinct ports */}}
{{- if has $c.observability.metrics_host (list "127.0.0.1" "localhost" "::1") -}}
{{- fail (printf "config.observability.metrics_host=%s: the kubelet probes /healthz and /readyz and Prometheus scrapes /metrics on the pod IP; use 0.0.0.0" $c.observability.metrics_host) -}}
{{- end -}}
{{- if and $c.query.enabled (eq (int $c.query.port) (int $c.observability.metrics_port)) -}}
{{- fail (printf "config.query.port and config.observability.metrics_port are both %v: the query API and /metrics need their own ports" $c.query.port) -}}
{{- end -}}

{{/* Deployment strategy and NetworkPolicy */}}
{{- with .Values.strategy -}}
{{- if and (eq (default "RollingUpdate" .type) "Recreate") .rollingUpdate -}}
{{- fail "strategy.rollingUpdate is only for strategy.type RollingUpdate (Recreate stops every pod first): remove one of them" -}}
{{- end -}}
{{- with .rollingUpdate -}}
{{- if and (hasKey . "maxSurge") (hasKey . "maxUnavailable") (has (toString .maxSurge) (list "0" "0%")) (has (toString .maxUnavailable) (list "0" "0%")) -}}
{{- fail "strategy.rollingUpdate: maxSurge and maxUnavailable cannot both be 0 (the rollout could never replace a pod); with maxSurge 0 set maxUnavailable to 1" -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $np := .Values.networkPolicy -}}
{{- if $np.enabled -}}
{{- if and .Values.monitoring.serviceMonitor.enabled (not $np.metrics.from) -}}
{{- fail "networkPolicy.enabled with monitoring.serviceMonitor.enabled needs networkPolicy.metrics.from: the peers Prometheus scrapes from (e.g. [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: monitoring}}}]), or the policy blocks every scrape" -}}
{{- end -}}
{{- if and (kindIs "slice" $np.egress) (not $np.egress) -}}
{{- fail "networkPolicy.egress: [] would block the sink's connections to the Kafka brokers and the object store: list the rules that allow DNS, the brokers and the object store, or set null to leave egress open" -}}
{{- end -}}
{{- end -}}

{{- $pdb := .Values.podDisruptionBudget -}}
{{- if and $pdb.enabled (not (kindIs "invalid" $pdb.minAvailable)) (not (kindIs "invalid" $pdb.maxUnavailable)) -}}
{{- fail "podDisruptionBudget: set minAvailable or maxUnavailable, not both (set the other to null)" -}}
{{- end -}}

{{/* derived numbers fail on their own when invalid */}}
{{- $_ := include "lance-sink.gracePeriod" . -}}
{{- $_ := include "lance-sink.memoryLimit" . -}}

{{/* memory: the settings' own rule (config/settings.py Settings._cross), then the pod's limit */}}
{{- $budgetRaw := $c.backpressure.process_budget_bytes -}}
{{- $budget := include "lance-sink.bytes" (list "config.backpressure.process_budget_bytes" $budgetRaw) | int64 -}}
{{- $memtable := include "lance-sink.bytes" (list "config.memtable.max_bytes" $c.memtable.max_bytes) | int64 -}}
{{- $budgetShow := printf "%d bytes" $budget -}}
{{- if kindIs "string" $budgetRaw -}}{{- $budgetShow = printf "%s = %s" $budgetRaw $budgetShow -}}{{- end -}}
{{- if lt $budget (mul 2 $memtable) -}}
{{- $memtableShow := printf "%d bytes" $memtable -}}
{{- if kindIs "string" $c.memtable.max_bytes -}}{{- $memtableShow = printf "%s = %s" $c.memtable.max_bytes $memtableShow -}}{{- end -}}
{{- fail (printf "config.memtable.max_bytes (%s) is above what config.backpressure.process_budget_bytes (%s) allows: the budget must be at least 2 x memtable.max_bytes (one memtable fills while the previous one flushes; the sink refuses to start otherwise). Lower memtable.max_bytes to at most %d bytes or raise the budget to at least %d bytes." $memtableShow $budgetShow (div $budget 2) (mul 2 $memtable)) -}}
{{- end -}}
{{- with .Values.resources.limits.memory -}}
{{- $limit := include "lance-sink.quantityBytes" (list "resources.limits.memory" .) | float64 -}}
{{- $needMiB := include "lance-sink.memoryNeedMiB" $ | int64 -}}
{{- if gt (mulf $needMiB 1048576) $limit -}}
{{- $factor := $.Values.resources.memory.budgetFactor -}}
{{- $budgetMiB := divf (mulf $budget $factor) 1048576 | ceil | int64 -}}
{{- $fixedMiB := sub $needMiB $budgetMiB -}}
{{- $roomMiB := subf (divf $limit 1048576) $fixedMiB -}}
{{- $fix := "Raise" -}}
{{- if gt $roomMiB 0.0 -}}
{{- $fix = printf "Lower the budget to at most %dMiB, raise" (divf $roomMiB $factor | floor | int64) -}}
{{- end -}}
{{- $limitShow := printf "%d bytes" (int64 $limit) -}}
{{- if kindIs "string" . -}}{{- $limitShow = . -}}{{- end -}}
{{- fail (printf "config.backpressure.process_budget_bytes (%s) does not fit in resources.limits.memory (%s): the pod needs %dMi = %dMi for the budget (x resources.memory.budgetFactor %v) + %dMi resources.memory.overheadMiB + %dMi for the query API's caches (unindexed rows, Lance's index and metadata caches) and the maintenance process, so the kernel would OOM-kill the sink before backpressure pauses a partition. %s resources.limits.memory to at least %dMi, or leave it null to derive it." $budgetShow $limitShow $needMiB $budgetMiB $factor (int64 $.Values.resources.memory.overheadMiB) (sub $fixedMiB (int64 $.Values.resources.memory.overheadMiB)) $fix $needMiB) -}}
{{- end -}}
{{- end -}}
{{/* the request may not exceed the limit (the API server refuses such a pod) */}}
{{- with .Values.resources.requests.memory -}}
{{- $request := include "lance-sink.quantityBytes" (list "resources.requests.memory" .) | float64 -}}
{{- $limitMem := include "lance-sink.memoryLimit" $ -}}
{{- $limitBytes := include "lance-sink.quantityBytes" (list "resources.limits.memory" $limitMem) | float64 -}}
{{- if gt $request $limitBytes -}}
{{- $limitFrom := "resources.limits.memory" -}}
{{- if not $.Values.resources.limits.memory -}}
{{- $limitFrom = "derived from config.backpressure.process_budget_bytes since resources.limits.memory is null" -}}
{{- end -}}
{{- fail (printf "resources.requests.memory (%v) is above the container's memory limit (%s, %s): the API server refuses a pod whose request exceeds its limit. Lower resources.requests.memory to at most %s (or leave it null: it defaults to the limit), or set resources.limits.memory to at least %v." . $limitMem $limitFrom $limitMem .) -}}
{{- end -}}
{{- end -}}
{{/* the same for CPU, when both are set */}}
{{- if and .Values.resources.requests.cpu .Values.resources.limits.cpu -}}
{{- $cpuRequest := include "lance-sink.cpuMillis" (list "resources.requests.cpu" .Values.resources.requests.cpu) | float64 -}}
{{- $cpuLimit := include "lance-sink.cpuMillis" (list "resources.limits.cpu" .Values.resources.limits.cpu) | float64 -}}
{{- if gt $cpuRequest $cpuLimit -}}
{{- fail (printf "resources.requests.cpu (%v) is above resources.limits.cpu (%v): the API server refuses a pod whose request exceeds its limit. Lower resources.requests.cpu to at most %v, or raise resources.limits.cpu (or leave it null: no limit)." .Values.resources.requests.cpu .Values.resources.limits.cpu .Values.resources.limits.cpu) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
A Kubernetes CPU quantity in millicores: (list "key" value), e.g. "500m" -> 500, "2" or 2
-> 2000, "0.5" -> 500. Anything else fails the render naming the key.
*/}}
{{- define "lance-sink.cpuMillis" -}}
{{- $key := index . 0 -}}
{{- $value := toString (index . 1) -}}
{{- if regexMatch "^[0-9]+m$" $value -}}
{{- trimSuffix "m" $value | float64 -}}
{{- else if regexMatch "^[0-9]+(\\.[0-9]+)?$" $value -}}
{{- mulf (float64 $value) 1000 -}}
{{- else -}}
{{- fail (printf "%s: cannot read %q as a Kubernetes CPU quantity (e.g. 500m, 2)" $key $value) -}}
{{- end -}}
{{- end -}}
