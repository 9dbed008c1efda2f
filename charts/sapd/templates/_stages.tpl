{{/* The stage Jobs, each as one named template rendered into the pipeline-templates ConfigMap, from
     which the driver (mode pipeline) and the gate Jobs (mode manual) create them. Call with
     (dict "root" $ "round" R): R is the round as a string, or "__SAPD_ROUND__", which the driver replaces
     with the round it starts; "" means no round (build-prefixes).
     `manual` true (the gate Jobs Helm renders) adds a name suffix from a hash of the release's values:
     Jobs are immutable, so an upgrade that changes any value replaces the gates (new names; Helm deletes
     the old ones, the new ones adopt the stage Jobs, which belong to the ConfigMap) instead of patching
     them, and an upgrade that changes nothing leaves them running. */}}

{{/* "<release>-<stage>[-r<R>][-<values hash>]" with room for 4 round digits and `.hostSuffix` more
     characters (an Indexed Job's pods are named "<job>-<index>", a JobSet's "<js>-node-0-<index>"),
     so that every pod hostname stays a 63-character DNS label. */}}
{{- define "sapd.stageName" -}}
{{- $suffix := "" -}}
{{- if .manual -}}{{- $suffix = toJson .root.Values | sha256sum | trunc 5 -}}{{- end -}}
{{- $reserve := int (.hostSuffix | default 0) -}}
{{- if .round -}}{{- $reserve = add $reserve 6 -}}{{- end -}}
{{- if $suffix -}}{{- $reserve = add $reserve (add 1 (len $suffix)) -}}{{- end -}}
{{- $name := include "sapd.name" (dict "root" .root "component" .component "max" (sub 63 $reserve)) -}}
{{- if .round -}}{{- $name = printf "%s-r%s" $name .round -}}{{- end -}}
{{- if $suffix -}}{{- $name = printf "%s-%s" $name $suffix -}}{{- end -}}
{{- $name -}}
{{- end -}}

{{- define "sapd.stageMeta" -}}
{{- $s := include "sapd.settings" . | fromYaml -}}
name: {{ include "sapd.stageName" . }}
labels:
  {{- include "sapd.jobLabels" . | nindent 2 }}
{{- with $s.jobAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "sapd.buildPrefixesJob" -}}
{{- $c := dict "root" .root "component" "build-prefixes" "job" .root.Values.buildPrefixes "round" "" }}
apiVersion: batch/v1
kind: Job
metadata:
  {{- include "sapd.stageMeta" $c | nindent 2 }}
spec:
  {{- include "sapd.batchFields" $c | trim | nindent 2 }}
  template:
    metadata:
      {{- include "sapd.podMeta" $c | nindent 6 }}
    spec:
      {{- include "sapd.podCommon" $c | nindent 6 }}
      containers:
        - name: build-prefixes
          {{- include "sapd.containerCommon" $c | nindent 10 }}
          args: [python, -m, jobs.build_prefixes, --config, /etc/sapd/config.yaml]
          env:
            {{- include "sapd.env" $c | nindent 12 }}
{{- end -}}

{{- define "sapd.teacherScoresResources" -}}
{{- $v := .root.Values.teacherScores -}}
{{- $res := deepCopy $v.resources -}}
{{- $gpus := max (int $v.tensorParallelSize) (int $v.teacherTensorParallelSize) -}}
{{- if gt $gpus 1 -}}
{{- range $k := list "requests" "limits" -}}
{{- $_ := set (get $res $k | default dict) "nvidia.com/gpu" $gpus -}}
{{- end -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{- define "sapd.teacherScoresJob" -}}
{{- $workers := int .root.Values.teacherScores.parallelism }}
{{- $c := dict "root" .root "component" "teacher-scores" "job" .root.Values.teacherScores "round" .round "index" true "perIndex" true "hostSuffix" (add 1 (len (toString (sub $workers 1)))) }}
{{- $_ := set $c "resources" (include "sapd.teacherScoresResources" $c | fromYaml) }}
# Indexed Job: pod i of `workers` is teacher-scores worker i (JOB_COMPLETION_INDEX); a retried index
# redoes only its own uncommitted part; the last worker to finish commits the round.
apiVersion: batch/v1
kind: Job
metadata:
  {{- include "sapd.stageMeta" $c | nindent 2 }}
spec:
  completionMode: Indexed
  completions: {{ $workers }}
  parallelism: {{ $workers }}
  {{- include "sapd.batchFields" $c | trim | nindent 2 }}
  template:
    metadata:
      {{- include "sapd.podMeta" $c | nindent 6 }}
    spec:
      {{- include "sapd.podCommon" $c | nindent 6 }}
      containers:
        - name: teacher-scores
          {{- include "sapd.containerCommon" $c | nindent 10 }}
          args: [python, -m, jobs.teacher_scores, --config, /etc/sapd/config.yaml, --round, {{ .round | quote }}]
          env:
            {{- include "sapd.env" $c | nindent 12 }}
{{- end -}}

{{/* The torchrun container of the train stage (Indexed Job or JobSet): node rank = completion index. */}}
{{- define "sapd.trainPodSpec" -}}
{{- $c := .c }}
{{- $t := .root.Values.train }}
{{- $gpus := (($t.resources.limits | default dict) | dig "nvidia.com/gpu" 0) | int }}
{{- if and (gt $gpus 0) (ne $gpus (int $t.procsPerPod)) }}
{{- fail (printf "train.procsPerPod (%d) must equal the GPUs each train pod requests (%d)" (int $t.procsPerPod) $gpus) }}
{{- end }}
{{- include "sapd.podCommon" $c }}
{{- with .subdomain }}
subdomain: {{ . }}
{{- end }}
containers:
  - name: train
    {{- include "sapd.containerCommon" $c | nindent 4 }}
    args:
      - torchrun
      - --nnodes={{ int $t.parallelism }}
      - --nproc-per-node={{ int $t.procsPerPod }}
      - --node-rank=$(NODE_RANK)
      - --master-addr={{ .masterAddr }}
      - --master-port={{ int $t.rendezvousPort }}
      # every pod waits this long for the whole group (torchrun's static rendezvous: 600 s by default)
      - --rdzv-conf=timeout={{ int $t.rendezvousTimeoutSeconds }}
      - -m
      - jobs.train
      - --config
      - /etc/sapd/config.yaml
      - --round
      - {{ .round | quote }}
    ports:
      - name: rendezvous
        containerPort: {{ int $t.rendezvousPort }}
      - name: metrics
        containerPort: {{ int $t.metricsPort }}
    env:
      {{- include "sapd.env" $c | nindent 6 }}
{{- end -}}

{{- define "sapd.trainEnv" -}}
# OpenMP threads that spin while waiting starve DeepSpeed's and gloo's own threads when a rank's
# threads take every CPU core (a tiny model's steps ran 15-20x slower on CPU: docs/results/EFFICIENCY.md)
- name: OMP_WAIT_POLICY
  value: PASSIVE
- name: NODE_RANK
  valueFrom:
    fieldRef:
      fieldPath: metadata.annotations['batch.kubernetes.io/job-completion-index']
- name: SAPD_METRICS_PORT
  value: {{ .root.Values.train.metricsPort | quote }}
- name: SAPD_METRICS_ADDR
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- end -}}

{{- define "sapd.trainJob" -}}
{{- if eq .root.Values.train.launcher "jobset" }}
{{- include "sapd.trainJobSet" . }}
{{- else }}
{{- $nodes := int .root.Values.train.parallelism }}
{{- $c := dict "root" .root "component" "train" "job" .root.Values.train "round" .round "gang" true "hostSuffix" (add 1 (len (toString (sub $nodes 1)))) }}
{{- $_ := set $c "env" (include "sapd.trainEnv" $c | fromYamlArray) }}
{{- $svc := include "sapd.name" (dict "root" .root "component" "train") }}
{{- $name := include "sapd.stageName" $c }}
# Indexed Job of `parallelism` torchrun pods: node rank = completion index; the rendezvous is pod 0
# (hostname <job>-0) through the headless Service. backoffLimit 0: one failed pod fails the Job and the
# driver recreates the whole group (a static torchrun rendezvous cannot take one replaced rank); a
# preempted pod fails it too (podFailurePolicy rule 0), and that restart is not counted.
apiVersion: batch/v1
kind: Job
metadata:
  {{- include "sapd.stageMeta" $c | nindent 2 }}
spec:
  completionMode: Indexed
  completions: {{ $nodes }}
  parallelism: {{ $nodes }}
  {{- include "sapd.batchFields" $c | trim | nindent 2 }}
  template:
    metadata:
      {{- include "sapd.podMeta" $c | nindent 6 }}
    spec:
      {{- include "sapd.trainPodSpec" (dict "root" .root "c" $c "round" .round "subdomain" $svc "masterAddr" (printf "%s-0.%s" $name $svc)) | nindent 6 }}
{{- end }}
{{- end -}}

{{/* The train stage as a JobSet (jobset.x-k8s.io/v1alpha2): one replicated Job "node" of `parallelism`
     Indexed pods; JobSet creates the headless Service (named after the JobSet) and restarts the whole
     group up to `maxRestarts` times. The child Job's podFailurePolicy fails it on a preempted pod (rule 0)
     or exit code 2 (rule 1), and JobSet's rules tell the two apart by the rule index in the failure
     message (onJobFailureMessagePatterns, JobSet >= 0.10; its host-maintenance pattern): a preemption
     restarts the group without counting against maxRestarts, exit code 2 fails the JobSet at once. */}}
{{- define "sapd.trainJobSet" -}}
{{- $nodes := int .root.Values.train.parallelism }}
{{- $c := dict "root" .root "component" "train" "job" .root.Values.train "round" .round "gang" true "hostSuffix" (add 8 (len (toString (sub $nodes 1)))) }}
{{- $_ := set $c "env" (include "sapd.trainEnv" $c | fromYamlArray) }}
{{- $name := include "sapd.stageName" $c }}
apiVersion: jobset.x-k8s.io/v1alpha2
kind: JobSet
metadata:
  {{- include "sapd.stageMeta" $c | nindent 2 }}
spec:
  ttlSecondsAfterFinished: {{ int .root.Values.train.ttlSecondsAfterFinished }}
  failurePolicy:
    maxRestarts: {{ int .root.Values.train.maxRestarts }}
    rules:
      - name: preempted
        action: RestartJobSetAndIgnoreMaxRestarts
        onJobFailureReasons: [PodFailurePolicy]
        onJobFailureMessagePatterns: ["matching FailJob rule at index 0$"]
      - name: permanent-error
        action: FailJobSet
        onJobFailureReasons: [PodFailurePolicy]
        onJobFailureMessagePatterns: ["matching FailJob rule at index 1$"]
  network:
    enableDNSHostnames: true
    publishNotReadyAddresses: true
  replicatedJobs:
    - name: node
      replicas: 1
      template:
        metadata:
          labels:
            {{- include "sapd.labels" $c | nindent 12 }}
            sapd.io/round: {{ .round | quote }}
        spec:
          completionMode: Indexed
          completions: {{ $nodes }}
          parallelism: {{ $nodes }}
          {{- include "sapd.batchFields" $c | trim | nindent 10 }}
          template:
            metadata:
              {{- include "sapd.podMeta" $c | nindent 14 }}
            spec:
              {{- include "sapd.trainPodSpec" (dict "root" .root "c" $c "round" .round "masterAddr" (printf "%s-node-0-0.%s" $name $name)) | nindent 14 }}
{{- end -}}

{{- define "sapd.trainService" -}}
{{- $c := dict "root" .root "component" "train" }}
# Headless Service: gives every train pod a DNS name (<job>-<index>.<service>) so torchrun on each pod
# reaches the rendezvous on pod 0, and Prometheus finds rank 0's /metrics.
apiVersion: v1
kind: Service
metadata:
  name: {{ include "sapd.name" $c }}
  labels:
    {{- include "sapd.labels" $c | nindent 4 }}
spec:
  clusterIP: None
  # pods must resolve each other before any is Ready: rendezvous happens during startup
  publishNotReadyAddresses: true
  selector:
    {{- include "sapd.selectorLabels" $c | nindent 4 }}
  ports:
    - name: rendezvous
      port: {{ int .root.Values.train.rendezvousPort }}
      targetPort: rendezvous
    - name: metrics
      port: {{ int .root.Values.train.metricsPort }}
      targetPort: metrics
{{- end -}}

{{/* The evaluation pod: benchmark-specific data and servers, device & co. from the run config; with
     `.round` (the evaluate-r<R> Job, not the CronJob's) exactly checkpoint R is evaluated. */}}
{{- define "sapd.evaluatePod" -}}
{{- $c := .c }}
{{- $e := .root.Values.evaluate }}
{{- $bench := include "sapd.benchmark" $c }}
{{- $args := list "python" "-m" "jobs.evaluate" "--config" "/etc/sapd/config.yaml" }}
{{- with .round }}{{ $args = concat $args (list "--checkpoint" (toString .)) }}{{ end }}
{{- range $e.args }}{{ $args = append $args (toString .) }}{{ end }}
{{- if eq $bench "alfworld" }}
{{- $_ := set $c "extraVolumes" (list (dict "name" "alfworld" "persistentVolumeClaim" (dict "claimName" (include "sapd.alfworldClaim" .root) "readOnly" true))) }}
{{- $_ := set $c "extraMounts" (list (dict "name" "alfworld" "mountPath" "/data/alfworld" "readOnly" true)) }}
{{- $args = concat $args (list "--data-dir" "/data/alfworld") }}
{{- else if eq $bench "webshop" }}
{{- $args = concat $args (list "--webshop-url" (required "evaluate.webshop.url is required for benchmark webshop: the URL of your WebShop server (docs/kubernetes/operate.md \"Evaluation\"; the chart deploys none)" $e.webshop.url)) }}
{{- $_ := set $c "webshop" true }}
{{- else if eq $bench "searchqa" }}
{{- $url := $e.searchqa.retrieverUrl | default (ternary (printf "http://%s:%d" (include "sapd.name" (dict "root" .root "component" "retriever")) (int $e.searchqa.retriever.port)) "" $e.searchqa.retriever.enabled) }}
{{- $args = concat $args (list "--rows" $e.searchqa.rows "--retriever-url" (required "evaluate.searchqa.retrieverUrl (or evaluate.searchqa.retriever.enabled) is required for benchmark searchqa" $url)) }}
{{- end }}
{{- include "sapd.podCommon" $c }}
containers:
  - name: evaluate
    {{- include "sapd.containerCommon" $c | nindent 4 }}
    args: {{ toJson $args }}
    env:
      {{- include "sapd.env" $c | nindent 6 }}
      {{- if eq $bench "alfworld" }}
      - name: ALFWORLD_DATA
        value: /data/alfworld
      {{- end }}
{{- end -}}

{{/* The claim holding ALFWorld's game files: the user's, or the one this release creates. */}}
{{- define "sapd.alfworldClaim" -}}
{{- .Values.evaluate.alfworld.claimName | default (include "sapd.name" (dict "root" . "component" "alfworld-data")) -}}
{{- end -}}

{{- define "sapd.evaluateContext" -}}
{{- $flavor := ternary "eval" .root.Values.image.flavor (eq .root.Values.image.flavor "gpu") }}
{{- toYaml (dict "component" "evaluate" "flavor" $flavor "shm" .root.Values.evaluate.shmSize) }}
{{- end -}}

{{- define "sapd.evaluateJob" -}}
{{- $c := merge (dict "root" .root "job" .root.Values.evaluate "round" .round) (include "sapd.evaluateContext" . | fromYaml) }}
apiVersion: batch/v1
kind: Job
metadata:
  {{- include "sapd.stageMeta" $c | nindent 2 }}
spec:
  {{- include "sapd.batchFields" $c | trim | nindent 2 }}
  template:
    metadata:
      {{- include "sapd.podMeta" $c | nindent 6 }}
    spec:
      {{- include "sapd.evaluatePod" (dict "root" .root "c" $c "round" .round) | nindent 6 }}
{{- end -}}

{{/* mode manual: the gate of one stage of round `round` — the driver limited to that stage
     (python -m jobs.pipeline --stage S --round K). Its small pod waits until the stage's input is
     committed, then creates the stage Job from the pipeline-templates ConfigMap (so no GPU is held, and no
     deadline runs, while a stage waits), adopts it if it exists, and retries it like the driver does. */}}
{{- define "sapd.gateJob" -}}
{{- $templates := include "sapd.name" (dict "root" .root "component" "pipeline-templates") }}
{{- $vols := list (dict "name" "stage-templates" "configMap" (dict "name" $templates)) }}
{{- $mounts := list (dict "name" "stage-templates" "mountPath" "/etc/sapd-pipeline" "readOnly" true) }}
{{- $sa := include "sapd.name" (dict "root" .root "component" "pipeline") }}
{{- $c := dict "root" .root "component" (printf "gate-%s" .stage) "job" .root.Values.pipeline "round" .round "manual" true "extraVolumes" $vols "extraMounts" $mounts "serviceAccount" $sa "automount" true "failJobCodes" (list 1 2) "configKey" "pipeline" }}
{{- $args := list "python" "-m" "jobs.pipeline" "--config" "/etc/sapd/config.yaml" "--release" .root.Release.Name "--templates" "/etc/sapd-pipeline" "--owner" (printf "configmap/%s" $templates) "--retries" (toString (int .root.Values.pipeline.stageRetries)) "--poll-seconds" (toString (int .root.Values.manual.pollSeconds)) "--log-every-seconds" (toString .root.Values.pipeline.logEverySeconds) "--stage" .stage }}
{{- with .round }}{{ $args = concat $args (list "--round" (toString .)) }}{{ end }}
{{- if .root.Values.pipeline.forceTakeover }}{{ $args = append $args "--force-takeover" }}{{ end }}
apiVersion: batch/v1
kind: Job
metadata:
  {{- include "sapd.stageMeta" $c | nindent 2 }}
spec:
  {{- include "sapd.batchFields" $c | trim | nindent 2 }}
  template:
    metadata:
      {{- include "sapd.podMeta" $c | nindent 6 }}
    spec:
      {{- include "sapd.podCommon" $c | nindent 6 }}
      containers:
        - name: {{ printf "gate-%s" .stage }}
          {{- include "sapd.containerCommon" $c | nindent 10 }}
          args: {{ toJson $args }}
          env:
            {{- include "sapd.env" $c | nindent 12 }}
{{- end -}}
